"""Text for calibration and evaluation: examples from dialogues and documents, content tasks,
synthetic prompts."""
