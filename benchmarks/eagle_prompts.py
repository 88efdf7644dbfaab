"""Chat prompts for training an EAGLE head (`train_eagle.py`) and, held out from them, for
measuring it (`bench_eagle.py`). The training prompts cross question templates with subjects:
everyday things for two prompts in three, Python's own help topics and standard-library modules
for the rest; the held-out prompts are written apart, with templates and subjects the training
set does not use."""

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


# More everyday subjects, and question forms of their own: the held-out prompts are everyday
# questions, so the training set leans on everyday subjects (two in three prompts) rather than
# on Python's modules. None of these names a held-out prompt's subject.
MORE_EVERYDAY = [
    "a lemon", "a violin", "the Eiffel Tower", "a thunderstorm", "a kitchen knife", "a snail", "a bicycle helmet",
    "penguins", "a submarine", "a toothbrush", "the Great Wall of China", "a candle", "a wristwatch", "a pencil",
    "an umbrella", "a microwave oven", "a washing machine", "a public library card", "a subway", "a skyscraper",
    "a coral reef", "a glacier", "a rainforest", "a tornado", "the Pacific Ocean", "the Sahara", "a waterfall",
    "elephants", "owls", "wolves", "sharks", "butterflies", "ants", "horses", "dolphins", "octopuses", "a hamster",
    "a goldfish", "a parrot", "tomatoes", "rice", "chocolate", "cheese making", "pizza", "pancakes", "olive oil",
    "strawberries", "a sandwich", "sushi", "apples", "potatoes", "salt", "sugar", "yoghurt", "spices", "a smoothie",
    "gardening tools", "a vegetable garden", "composting", "a greenhouse", "a lawn mower", "a hammer", "a ladder",
    "a screwdriver", "paint", "a tent", "a backpack", "hiking boots", "a compass", "a fishing rod", "a kayak",
    "swimming", "running shoes", "yoga", "basketball", "tennis", "cycling", "skiing", "a gym", "stretching",
    "a nurse", "a firefighter", "a pilot", "a carpenter", "a chef", "a farmer", "an architect", "a journalist",
    "a librarian", "a dentist", "a plumber", "a translator", "a scientist", "a judge", "a shopkeeper",
    "a bank account", "a credit card", "taxes", "a budget spreadsheet", "insurance", "a mortgage", "inflation",
    "a small business", "a job application", "a resume", "a meeting", "an email inbox", "a calendar", "a deadline",
    "a password", "a smartphone", "a laptop battery", "a keyboard", "a printer", "a web browser", "a search engine",
    "a database", "an operating system", "a text editor", "version control", "a compiler", "an API", "a website",
    "a video game", "a social network", "a podcast", "a movie theatre", "a concert", "a novel", "poetry", "painting",
    "sculpture", "a photograph album", "a board game", "a jigsaw puzzle", "a crossword", "magic tricks", "dancing",
    "singing", "a guitar", "drums", "an orchestra", "a choir", "a theatre play", "comic books", "a fairy tale",
    "gravity", "magnetism", "atoms", "light", "sound", "heat", "friction", "a battery", "a magnet", "a microscope",
    "the human brain", "bones", "muscles", "the lungs", "teeth", "the eyes", "skin", "blood", "sleep habits",
    "vitamins", "exercise", "a balanced diet", "drinking water", "a first aid kit", "a cold", "allergies",
    "the Roman Empire", "ancient Egypt", "the Middle Ages", "the Renaissance", "the Industrial Revolution",
    "the invention of the telephone", "the first moon landing", "castles", "pyramids", "knights", "pirates",
    "a village", "a harbour", "a highway", "traffic lights", "a bus stop", "a post office", "a supermarket",
    "a restaurant", "a hotel", "a hair salon", "a bank", "a police station", "a zoo", "an aquarium", "a playground",
    "a wedding dress", "a birthday cake", "a holiday", "a new year", "a family dinner", "a picnic", "a road trip",
    "a pet dog", "a neighbour", "a roommate", "a best friend", "grandparents", "a baby", "teenagers", "a teacher's day",
    "kindness", "patience", "honesty", "courage", "curiosity", "time management", "public speaking", "teamwork",
    "stress", "happiness", "boredom", "motivation", "a morning routine", "a to-do list", "procrastination",
    "electric cars", "wind turbines", "plastic waste", "clean air", "a recycling bin", "saving energy at home",
]

MORE_TEMPLATES = [
    "How do I take care of {}?",
    "What should I know before buying {}?",
    "Write a funny short poem about {}.",
    "Give me a few ideas involving {}.",
    "What is the history behind {}?",
    "Write a short letter to a friend about {}.",
    "Explain how {} is made.",
    "What are three interesting questions about {}?",
    "Describe {} in one paragraph.",
    "Write a song verse about {}.",
    "What would a scientist say about {}?",
    "Give me a simple plan for learning about {}.",
    "Why might someone dislike {}?",
    "Write two sentences that use the word {}.",
    "Tell me something most people do not know about {}.",
    "How has {} changed over the last hundred years?",
    "What is the best thing about {}?",
    "Write a short review of {}.",
    "Pretend you are {} and introduce yourself.",
    "What safety tips apply to {}?",
]


# How user requests begin, for the requests the target writes itself (`train_eagle.py
# --self-written`): the openers are English's common request forms, the rest is the target's.
OPENERS = [
    "How do I", "How can I", "How does", "How many", "How long", "What is", "What are", "What does", "What should I",
    "What happens when", "Why do", "Why is", "Why does", "When did", "Where can I", "Who was", "Which is better,",
    "Is it", "Should I", "Can you", "Could you", "Please", "Write a", "Write an", "Give me", "Tell me", "Explain",
    "Describe", "Suggest", "Help me", "I need", "I want to", "Make a", "Create a", "Plan", "List", "Compare",
    "Summarize", "Recommend", "Translate", "Name", "Find", "Show me", "Teach me", "My", "I have",
]

SELF_WRITTEN_PREFIX = "Here are some requests that people sent to a helpful assistant:\n\n- "


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


def word_subjects(tokenizer, num: int, seed: int = 0, first_ids: int = 32768) -> list[str]:
    """`num` English words drawn from the tokenizer's first `first_ids` ids (its commonest merges),
    each a whole-word token of 4+ lowercase letters: subjects whose words the template subjects
    lack. The target's answers copy their prompts, so these teach the head to copy words it would
    otherwise never have drafted."""
    words = []
    for i in range(first_ids):
        piece = tokenizer.decode([i])
        if piece.startswith(" ") and piece[1:].isascii() and piece[1:].isalpha() and piece[1:].islower() \
                and len(piece) >= 5:
            words.append(piece[1:])
    random.Random(seed).shuffle(words)
    return words[:num]


def word_prompts(tokenizer, num: int, seed: int = 0) -> list[str]:
    """`num` prompts crossing the training templates with `word_subjects`, one or two words each."""
    rng = random.Random(seed + 1)
    words = word_subjects(tokenizer, 2 * num, seed)
    if num and not words:
        raise ValueError("the tokenizer's first ids hold no whole-word tokens to make word prompts from")
    templates = TRAIN_TEMPLATES + MORE_TEMPLATES
    out = []
    for i in range(num):  # a vocabulary with fewer than 2 * num such words repeats them
        first, second = words[i % len(words)], words[(num + i) % len(words)]
        subject = first if rng.random() < 0.5 else f"{first} {second}"
        out.append(rng.choice(templates).format(subject))
    return out


def train_prompts(num: int, seed: int = 0) -> list[str]:
    """`num` distinct training prompts, in a seeded random order: two in three about everyday
    subjects, one in three about Python."""
    templates = TRAIN_TEMPLATES + MORE_TEMPLATES
    rng = random.Random(seed)
    everyday = [(t, s) for t in templates for s in EVERYDAY + MORE_EVERYDAY]
    python = [(t, s) for t in TRAIN_TEMPLATES for s in python_subjects()]
    rng.shuffle(everyday)
    rng.shuffle(python)
    want_python = min(len(python), num // 3)
    pairs = everyday[: num - want_python] + python[:want_python]
    rng.shuffle(pairs)
    return [t.format(s) for t, s in pairs]


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


# A development set for choosing a training recipe (`train_eagle.py` reports the head's top-1 on
# the target's answers to these): written apart from both the training templates and HELD_OUT,
# so HELD_OUT stays unseen by every choice made.
DEV = [
    "How do I remove a coffee stain from a shirt?",
    "Write a short bedtime story about a sleepy dragon.",
    "What is the capital of Australia?",
    "Give me a workout plan for beginners.",
    "How do bees make honey?",
    "Suggest three names for a pet rabbit.",
    "What is the difference between a virus and bacteria?",
    "Write a motivational quote for Monday morning.",
    "How can I fall asleep faster?",
    "Explain what inflation means for my savings.",
    "How do I center a div in CSS?",
    "What are the rules of chess for the knight?",
    "Write an apology message to a customer.",
    "Why do cats purr?",
    "Recommend a few books for a long flight.",
    "How do I sort a dictionary by value in Python?",
    "What is photosynthesis?",
    "Plan a budget-friendly dinner for four people.",
    "How does a bicycle gear system work?",
    "Write a few lines about the sea at night.",
    "What should I do if my car battery dies?",
    "Explain recursion with an example.",
    "What are the symptoms of dehydration?",
    "Describe a sunset over the mountains.",
    "How do I ask my boss for a raise?",
    "What is the tallest mountain in Europe?",
    "Translate 'good morning' into Spanish and French.",
    "Give me tips for taking better photos with my phone.",
    "What is blockchain in simple terms?",
    "Write a welcome message for a new neighbour.",
    "How long should I boil an egg?",
    "What does a database index do?",
]
