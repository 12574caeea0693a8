"""Assistant-style calibration data: everyday user questions answered by the target itself.

The chitchat dialogues the demo was calibrated on are casual talk between two people, so a
translator fitted on them carries a question's *register* well but its *content* poorly: the
target answers "Give me three tips for sleeping better." from a translated cache with
small talk. Self-distillation needs the target's behaviour on the prompts users type, so this
script writes conversations whose user turns come from templates x topic lists (below) and
whose assistant turns are the target's own answers (mlx-lm, greedy, repetition penalty 1.1 over
the demo's 256-token window, at most --answer-tokens tokens). A share of the conversations
(--multi-turn) asks 2-3 unrelated questions in a row, each answered with the earlier turns in
context, so calibration also sees a topic change after an answer.

Held-out split by topic: every list holds out the items with sha1(item) % 5 == 0, and a
held-out conversation uses only held-out items. Lists share words ("bread" is a thing, "bake
bread" an activity), so afterwards every held-out conversation that names a subject some
training question names is dropped (`drop_shared_subjects`): no held-out subject is ever
calibrated on.
Writes {"messages": [...]} records to --out/{train,heldout}.jsonl (default
~/.cache/mlx-kvlingo/data/assistant).

    OPENBLAS_NUM_THREADS=1 python -m weights.build.assistant_data --train 600 --heldout 80
    python -m weights.build.assistant_data --mix-only   # the stage-2 mix, from existing files

Then it writes ~/.cache/mlx-kvlingo/data/mixed-assistant/: the assistant
training conversations beside the first --mix-chat chitchat training dialogues and the first
--mix-pages prose and technical training pages of weights/build/text_data.py (run that first:
`python -m weights.build.text_data --mix-chat 1000`): the data of the assistant stage-2 runs in
weights/QUALITY.md; and ~/.cache/mlx-kvlingo/data/heldout-assistant-mix/, their early-stopping
set (the assistant held-out conversations and the chitchat held-out dialogues).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.models.demo.pair import demo_models
from mlx_kvlingo.models.demo.smollm2 import cache_root

THINGS = """volcanoes, rainbows, bicycles, honey bees, the moon, glaciers, coffee, tea, chocolate,
bread, cheese, penguins, elephants, dolphins, octopuses, owls, sharks, tigers, whales, ants,
the internet, computers, smartphones, batteries, solar panels, wind turbines, electric cars,
airplanes, submarines, trains, bridges, lighthouses, pyramids, castles, libraries, museums,
pianos, guitars, violins, drums, jazz, opera, chess, football, tennis, swimming, yoga,
photosynthesis, gravity, magnets, electricity, thunderstorms, earthquakes, tides, deserts,
rainforests, coral reefs, mountains, rivers, oceans, clouds, snowflakes, comets, black holes,
the sun, Mars, Jupiter, satellites, telescopes, microscopes, vaccines, antibiotics, sleep,
dreams, memory, the heart, the brain, bones, vitamins, recycling, compost, plastic, glass,
paper, cotton, wool, silk, diamonds, gold, copper, salt, sugar, rice, potatoes, tomatoes,
apples, bananas, oranges, strawberries, mushrooms, cactuses, sunflowers, oak trees, bamboo,
clocks, calendars, maps, compasses, umbrellas, candles, soap, toothpaste, money, banks,
taxes, elections, newspapers, podcasts, video games, movies, cartoons, novels, poetry,
dinosaurs, fossils, the Roman Empire, ancient Egypt, the Vikings, the printing press,
the steam engine, the telephone, photography, radio, robots, artificial intelligence,
cryptography, spreadsheets, email, passwords, the ocean floor, the Arctic, Antarctica""".split(",")

ACTIVITIES = """sleep better|sleeping better, boil an egg|boiling an egg, learn a new language|
learning a new language, save money|saving money, make friends in a new city|making friends in a
new city, start running|starting to run, bake bread|baking bread, grow tomatoes|growing tomatoes,
study for an exam|studying for an exam, focus at work|focusing at work, cook rice|cooking rice,
keep a plant alive|keeping a plant alive, write a cover letter|writing a cover letter, prepare for
a job interview|preparing for a job interview, clean a laptop screen|cleaning a laptop screen,
train a puppy|training a puppy, drink more water|drinking more water, wake up early|waking up
early, reduce stress|reducing stress, plan a trip|planning a trip, pack a suitcase|packing a
suitcase, make coffee|making coffee, learn to swim|learning to swim, paint a room|painting a
room, speak in public|speaking in public, read more books|reading more books, stay warm in
winter|staying warm in winter, keep a journal|keeping a journal, learn to code|learning to
code, take better photos|taking better photos, eat more vegetables|eating more vegetables,
fix a flat tire|fixing a flat tire, make pancakes|making pancakes, remember names|remembering
names, organize my desk|organizing my desk, start meditating|starting to meditate, write a
poem|writing a poem, learn the guitar|learning the guitar, stop procrastinating|stopping
procrastination, make a budget|making a budget, care for a cat|caring for a cat, cook
pasta|cooking pasta, build a campfire|building a campfire, stay motivated|staying motivated,
apologize to a friend|apologizing to a friend, negotiate a salary|negotiating a salary,
choose a good book|choosing a good book, make a smoothie|making a smoothie""".split(",")

PLACES = """France|Paris|French, Italy|Rome|Italian, Spain|Madrid|Spanish, Germany|Berlin|German,
Japan|Tokyo|Japanese, China|Beijing|Chinese, Egypt|Cairo|Arabic, Brazil|Brasilia|Portuguese,
Portugal|Lisbon|Portuguese, Russia|Moscow|Russian, Greece|Athens|Greek, Mexico|Mexico City|
Spanish, Canada|Ottawa|English and French, Australia|Canberra|English, India|New Delhi|Hindi,
Kenya|Nairobi|Swahili, Sweden|Stockholm|Swedish, Norway|Oslo|Norwegian, Poland|Warsaw|Polish,
Turkey|Ankara|Turkish, Argentina|Buenos Aires|Spanish, Peru|Lima|Spanish, Ireland|Dublin|
English, the Netherlands|Amsterdam|Dutch, Austria|Vienna|German, Thailand|Bangkok|Thai,
Vietnam|Hanoi|Vietnamese, South Korea|Seoul|Korean, Finland|Helsinki|Finnish, Chile|
Santiago|Spanish""".split(",")

ADJECTIVES = """hot, up, big, fast, happy, light, early, open, loud, old, rich, strong, wet,
soft, full, easy, near, high, thick, sharp, brave, clean, deep, empty, long, bright""".split(",")

FEELINGS = """tired, nervous, bored, lonely, stressed, sad, anxious, overwhelmed, unmotivated,
homesick, angry, confused""".split(",")

PETS = """cat, dog, goldfish, parrot, hamster, rabbit, turtle, puppy, kitten, horse""".split(",")

THING_TEMPLATES = [
    "What do you know about {t}?",
    "Tell me about {t}.",
    "Explain {t} to a ten-year-old.",
    "Give me three facts about {t}.",
    "Write a short poem about {t}.",
    "Why should I care about {t}?",
    "Describe {t} in two sentences.",
    "What is the history of {t}?",
    "What is interesting about {t}?",
    "Can you explain {t}?",
]
ACTIVITY_TEMPLATES = [
    "How do I {a}?",
    "Give me three tips for {g}.",
    "What is the best way to {a}?",
    "I want to {a}. Where should I start?",
    "What are common mistakes when {g}?",
    "Can you help me {a}?",
]
PLACE_TEMPLATES = [
    "What is the capital of {c}?",
    "What language is spoken in {c}?",
    "What should I visit in {city}?",
    "Tell me something about {c}.",
    "What food is {c} famous for?",
]
OTHER_TEMPLATES = [
    ("What is the opposite of {x}?", "ADJECTIVES"),
    ("I feel {x}. What should I do?", "FEELINGS"),
    ("Suggest a name for my {x}.", "PETS"),
    ("How do I take care of a {x}?", "PETS"),
]


def _items(raw: list[str]) -> list[str]:
    return [" ".join(s.split()) for s in raw if s.strip()]


def _held(item: str) -> bool:
    return int(hashlib.sha1(item.encode()).hexdigest(), 16) % 5 == 0


def question(rng: random.Random, heldout: bool) -> str:
    """One user question whose subject is in the requested split."""

    def pick(raw):
        pool = [i for i in _items(raw) if _held(i) == heldout]
        return rng.choice(pool)

    kind = rng.choices(["thing", "activity", "place", "other", "math"], [35, 30, 15, 15, 5])[0]
    if kind == "thing":
        return rng.choice(THING_TEMPLATES).format(t=pick(THINGS))
    if kind == "activity":
        a, g = (p.strip() for p in pick(ACTIVITIES).split("|"))
        return rng.choice(ACTIVITY_TEMPLATES).format(a=a, g=g)
    if kind == "place":
        c, city, _ = (p.strip() for p in pick(PLACES).split("|"))
        return rng.choice(PLACE_TEMPLATES).format(c=c, city=city)
    if kind == "other":
        template, lst = rng.choice(OTHER_TEMPLATES)
        return template.format(x=pick(globals()[lst]))
    a, b = rng.randint(2, 99), rng.randint(2, 99)  # arithmetic: no topic to leak
    return rng.choice(["What is {a} plus {b}?", "What is {a} times {b}?"]).format(a=a, b=b)


def named_subjects(question: str) -> set[str]:
    """Every listed subject a question names, as a word (a place by country or city)."""
    found = set()
    for name in ("THINGS", "ACTIVITIES", "PLACES", "PETS", "FEELINGS"):
        for item in _items(globals()[name]):
            words = [w.strip() for w in item.split("|")[:2]] if "|" in item else [item]
            if any(re.search(rf"\b{re.escape(w)}\b", question, re.I) for w in words):
                found.add(item)
    return found


def drop_shared_subjects(train: list[list[dict]], held: list[list[dict]]) -> list[list[dict]]:
    """The held-out conversations none of whose questions names a subject training names."""

    def questions(conv):
        return [m["content"] for m in conv if m["role"] == "user"]

    seen = set().union(*(named_subjects(q) for c in train for q in questions(c)))
    return [c for c in held if not any(named_subjects(q) & seen for q in questions(c))]


def clean_heldout(folder: Path) -> None:
    read = lambda f: [json.loads(x)["messages"] for x in (folder / f).read_text().splitlines()]  # noqa: E731
    held = read("heldout.jsonl")
    kept = drop_shared_subjects(read("train.jsonl"), held)
    (folder / "heldout.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in kept))
    print(f"held out: {len(kept)} of {len(held)} conversations name no training subject")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--train", type=int, default=600, help="training conversations")
    ap.add_argument("--heldout", type=int, default=80, help="held-out conversations")
    ap.add_argument("--multi-turn", type=float, default=0.3, help="share with 2-3 questions")
    ap.add_argument("--answer-tokens", type=int, default=80)
    ap.add_argument("--target", default=None, help="answering model (default: the demo target)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=cache_root() / "data" / "assistant")
    ap.add_argument("--mix-only", action="store_true", help="only (re)write the stage-2 mix")
    ap.add_argument("--mix-chat", type=int, default=400)
    ap.add_argument("--mix-pages", type=int, default=40)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not args.mix_only:
        answer_questions(args)
        clean_heldout(args.out)
    write_mix(args.out, args.mix_chat, args.mix_pages)
    write_heldout_mix(args.out)


def write_mix(assistant: Path, chats: int, pages: int) -> None:
    data = cache_root() / "data"
    mix, issue20 = data / "mixed-assistant", data / "mixed-issue20"
    mix.mkdir(parents=True, exist_ok=True)
    take = {"assistant-train.jsonl": (assistant / "train.jsonl", None),
            "chat-train.jsonl": (issue20 / "chat-train.jsonl", chats),
            "prose-train.jsonl": (issue20 / "prose-train.jsonl", pages),
            "technical-train.jsonl": (issue20 / "technical-train.jsonl", pages)}  # fmt: skip
    for name, (src, n) in take.items():
        if not src.exists():
            raise SystemExit(f"{src} is missing: see this script's docstring")
        lines = src.read_text().splitlines()[:n]
        (mix / name).write_text("".join(line + "\n" for line in lines))
    print(f"wrote {mix}")


def write_heldout_mix(assistant: Path) -> Path:
    """heldout-assistant-mix/: the assistant held-out conversations beside the chitchat held-out
    dialogues, the early-stopping set of the assistant stage-2 run (`--heldout-data`)."""
    from mlx_kvlingo.models.demo.pair import demo_data

    folder = cache_root() / "data" / "heldout-assistant-mix"
    folder.mkdir(parents=True, exist_ok=True)
    for name, src in (("assistant-heldout.jsonl", assistant / "heldout.jsonl"),
                      ("chitchat-heldout.jsonl", demo_data()[1])):  # fmt: skip
        if not src.exists():
            raise SystemExit(f"{src} is missing: see this script's docstring")
        (folder / name).write_text(src.read_text())
    print(f"wrote {folder}")
    return folder


def answer_questions(args) -> None:
    import mlx_lm
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = mlx_lm.load(str(args.target or demo_models()[1]))
    processors = make_logits_processors(repetition_penalty=1.1, repetition_context_size=256)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for split, n in (("heldout", args.heldout), ("train", args.train)):
        rng = random.Random(f"{args.seed}:{split}")
        seen, convs = set(), []  # each conversation's questions, distinct
        while len(convs) < n:
            turns = rng.choice([2, 3]) if rng.random() < args.multi_turn else 1
            qs = tuple(question(rng, split == "heldout") for _ in range(turns))
            if qs not in seen and len(set(qs)) == turns:
                seen.add(qs)
                convs.append(qs)
        msgs = [[] for _ in convs]
        for turn in range(3):  # turn k of every conversation that has one, in one batch
            live = [i for i, qs in enumerate(convs) if len(qs) > turn]
            if not live:
                break
            prompts = []
            for i in live:
                msgs[i].append({"role": "user", "content": convs[i][turn]})
                prompts.append(tok.apply_chat_template(msgs[i], add_generation_prompt=True))
            # greedy (mlx-lm's default sampler), the demo's repetition penalty
            res = mlx_lm.batch_generate(
                model, tok, prompts, max_tokens=args.answer_tokens,
                logits_processors=processors, completion_batch_size=64,
            )  # fmt: skip
            for i, text in zip(live, res.texts, strict=True):
                msgs[i].append({"role": "assistant", "content": text.strip()})
            print(f"{split}: turn {turn + 1}, {len(live)} answers "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
        tmp = args.out / f"{split}.jsonl.tmp"
        tmp.write_text("".join(json.dumps({"messages": m}) + "\n" for m in msgs))
        tmp.replace(args.out / f"{split}.jsonl")
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
