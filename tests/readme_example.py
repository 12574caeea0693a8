from mlx_kvlingo import Runtime  # import it before mlx: on Linux it preloads OpenBLAS

runtime = Runtime.load()  # the demo pair; or Runtime.load(source, target, translator_file)
chat = runtime.new_conversation(system_prompt="You are a concise assistant.")
for text, model in [("What is a KV cache?", "large"), ("Explain it to a child.", "small")]:
    for event in chat.send(text, model, max_tokens=48, sampling={"seed": 0}):  # large: small reads
        print(event.text if event.kind == "token" else f"\n[{event.status}]", end="", flush=True)
    print()
chat.save("chat.safetensors")  # later: chat = runtime.restore("chat.safetensors")
print(runtime.memory())
