"""Ten everyday questions with the word a right answer must contain: a quick check of what
the demo's target says, natively (tests/test_demo_moe.py) or from translated caches
(`answer_check.py`)."""

#: (question, words of which one must appear in the answer)
EVERYDAY_QUIZ = [
    ("What is the capital of France?", ("paris",)),
    ("How many days are there in a week?", ("7", "seven")),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What is the opposite of hot?", ("cold",)),
    ("Which animal says meow?", ("cat",)),
    ("What is the capital of Italy?", ("rome",)),
    ("What color is snow?", ("white",)),
    ("What is the opposite of up?", ("down",)),
    ("What language is spoken in Spain?", ("spanish",)),
    ("Which season comes after winter?", ("spring",)),
]


def is_right(answer: str, words) -> bool:
    answer = answer.lower()
    return any(w in answer for w in words)
