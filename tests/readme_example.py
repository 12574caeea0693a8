from mlx_kvlingo import load, make_prompt_cache, save_prompt_cache, stream_generate

pair = load()  # the demo pair; or load(small, large, translator_file)
cache = make_prompt_cache(pair, system_prompt="You are a concise assistant.")
for text, model in [("What is a KV cache?", "large"), ("Explain it to a child.", "small")]:
    for r in stream_generate(pair, text, cache, model=model, max_tokens=48, seed=0):
        print(r.text, end=f"\n[{r.status}]\n" if r.finish_reason else "", flush=True)
save_prompt_cache("chat.safetensors", cache)  # later: load_prompt_cache("chat.safetensors", pair)
print(pair.memory())
