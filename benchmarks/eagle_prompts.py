"""Chat prompts for training an EAGLE head (`train_eagle.py`) and, held out from them, for
measuring it (`bench_eagle.py`). The training prompts cross question templates with subjects
(Python's own help topics and standard-library modules, everyday things); the held-out prompts
are written apart, with templates and subjects the training set does not use."""

from __future__ import annotations

import random
import sys

TRAIN_TEMPLATES = [
    "Explain {} in simple words.",
    "What is {}?",
    "Write a short poem about {}.",
    "Give three facts about {}.",
    "Tell me a short story about {}.",
    "Summarize the idea of {} in two sentences.",
    "Why do people care about {}?",
    "Describe {} to a child.",
    "List some common questions about {}.",
    "Write a paragraph about the history of {}.",
    "What are the advantages and disadvantages of {}?",
    "How would you teach someone about {}?",
    "Write an email to a friend about {}.",
    "Compare {} with something similar.",
    "What is a common mistake people make with {}?",
    "How does {} work?",
    "Can you help me understand {}?",
    "I want to learn about {}. Where should I start?",
    "Write a tweet about {}.",
    "Give me five tips about {}.",
    "What would the world be like without {}?",
    "Explain {} step by step.",
    "Write a dialogue between two friends about {}.",
    "Make a list of ten words related to {}.",
    "What is the most surprising thing about {}?",
    "Write a riddle whose answer is {}.",
    "Write a short news report about {}.",
    "Create three quiz questions about {}, with answers.",
    "Describe a day in the life of someone who works with {}.",
    "Is {} important? Answer yes or no, then explain.",
    "Write Python code that has something to do with {}.",
    "Give a one-sentence definition of {}.",
    "Write an advertisement for {}.",
    "What questions would a beginner ask about {}?",
]

EVERYDAY = [
    "the ocean", "a bicycle", "coffee", "the moon", "a library", "rain", "bread", "a city park", "music",
    "the internet", "a garden", "winter", "a train journey", "friendship", "the sun", "a volcano", "chess",
    "cooking pasta", "a hospital", "a museum", "the weather", "a computer", "electricity", "a river", "birds",
    "a mountain", "a school", "football", "the stock market", "a forest", "honey bees", "a desert", "sleep",
    "a newspaper", "the piano", "a bridge", "recycling", "a rainbow", "tea", "a farm", "the alphabet",
    "an airport", "a telescope", "a lighthouse", "vaccines", "a marathon", "photography", "a map", "clocks",
    "the human heart", "dinosaurs", "a spreadsheet", "the printing press", "a bakery", "glass", "solar panels",
]


def python_subjects() -> list[str]:
    """Python's help topics and public standard-library module names."""
    from pydoc_data.topics import topics

    names = [m for m in sorted(sys.stdlib_module_names) if not m.startswith("_")]
    return [f"the Python '{name}' module" for name in names] + [f"{t.lower()} in Python" for t in sorted(topics)]


def topic_tokens_text() -> str:
    """Python's help topics, as one text: where the draft vocabulary takes more tokens than the
    answers hold."""
    from pydoc_data.topics import topics

    return "\n".join(topics.values())


def train_prompts(num: int, seed: int = 0) -> list[str]:
    """`num` distinct training prompts, in a seeded random order."""
    subjects = EVERYDAY + python_subjects()
    pairs = [(t, s) for t in TRAIN_TEMPLATES for s in subjects]
    random.Random(seed).shuffle(pairs)
    return [t.format(s) for t, s in pairs[:num]]


# Held out: none of these templates or subjects is in the training set.
HELD_OUT = [
    "How can I improve my handwriting?",
    "Plan a three-day trip to Rome for me.",
    "What should I pack for a camping weekend?",
    "Write a haiku about autumn leaves.",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a small bookshop.",
    "What is the difference between weather and climate?",
    "Give me a recipe for vegetable soup.",
    "How do airplanes stay in the air?",
    "Write a limerick about a cat who loves cheese.",
    "What are some tips for a job interview?",
    "Why is the sky blue?",
    "How do I reverse a list in JavaScript?",
    "Explain what a hash table is.",
    "Write a thank-you note to a teacher.",
    "What are good habits for learning a new language?",
    "Describe the water cycle.",
    "How do I make my houseplants grow better?",
    "What is a prime number? Give examples.",
    "Tell me a joke about programmers.",
    "How do I write a for loop in C?",
    "What causes earthquakes?",
    "Write a product description for a reusable water bottle.",
    "What is the best way to save money each month?",
    "Explain how a vaccine trains the immune system.",
    "Write the opening line of a mystery novel.",
    "How many planets are in the solar system? Name them.",
    "What is machine learning?",
    "Give me five ideas for a birthday party.",
    "How do I convert Celsius to Fahrenheit?",
    "Write a short speech for a wedding toast.",
    "What is the purpose of a firewall?",
]
