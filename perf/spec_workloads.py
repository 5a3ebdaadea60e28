"""The two workloads of ``perf/spec_bench.py``, as chat messages (texts written for pdserve).

Input-grounded: "rewrite this paragraph / code with one change", where most of the answer is
copied from the prompt - what prompt lookup is for. Open-ended: questions whose answers the
prompt does not contain.
"""

from __future__ import annotations

PARAGRAPHS = [
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every "
    "night its keeper climbed the spiral stairs, trimmed the wick and polished the great lens, "
    "so that ships passing in the dark would know where the rocks were. When the storms came in "
    "winter, the keeper stayed awake until dawn, watching the beam sweep across the water.",
    "Our team meets every Monday at nine to plan the week. Each person says what they finished, "
    "what they are working on, and what is blocking them. The meeting lasts fifteen minutes, and "
    "anything that needs a longer discussion is moved to a separate call in the afternoon, so "
    "that nobody has to sit through details that do not concern them.",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl, then add the warm "
    "water and stir until no dry flour remains. Cover the bowl with a towel and leave the dough "
    "to rise for two hours in a warm place. Shape it into a loaf, let it rest for another half "
    "hour, and bake it for forty minutes until the crust is golden brown.",
    "The library opens at eight in the morning and closes at six in the evening on weekdays. On "
    "Saturdays it opens at ten and closes at four, and on Sundays it is closed. Members may "
    "borrow up to ten books at a time for three weeks, and they can renew each book twice online "
    "as long as nobody else has reserved it.",
]

CODE = [
    "def average(values):\n    total = 0\n    count = 0\n    for value in values:\n"
    "        total += value\n        count += 1\n    if count == 0:\n        return 0\n"
    "    return total / count\n",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n"
    "    def add(self, word):\n        if word in self.counts:\n            self.counts[word] += 1\n"
    "        else:\n            self.counts[word] = 1\n\n    def most_common(self):\n"
    "        return max(self.counts, key=self.counts.get)\n",
    "def read_config(path):\n    settings = {}\n    with open(path) as handle:\n"
    "        for line in handle:\n            line = line.strip()\n"
    "            if not line or line.startswith('#'):\n                continue\n"
    "            key, value = line.split('=', 1)\n            settings[key.strip()] = value.strip()\n"
    "    return settings\n",
    "def find_user(users, name):\n    for user in users:\n        if user['name'] == name:\n"
    "            return user\n    return None\n\n\ndef list_admins(users):\n"
    "    return [user for user in users if user['role'] == 'admin']\n",
]

PARAGRAPH_CHANGES = [
    "replacing the word 'keeper' with 'guardian'",
    "replacing 'Monday' with 'Tuesday'",
    "replacing 'two hours' with 'three hours'",
    "replacing 'ten books' with 'twelve books'",
]
CODE_CHANGES = [
    "renaming the function 'average' to 'mean'",
    "renaming the method 'add' to 'record'",
    "renaming the variable 'settings' to 'options'",
    "renaming the function 'find_user' to 'get_user'",
]

OPEN_ENDED = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are some good habits for staying healthy while working from home?",
    "Describe your ideal weekend trip and what you would do there.",
    "Give me three ideas for a birthday party for a five-year-old.",
    "What is the difference between a virus and a bacterium?",
    "Write a poem about autumn leaves.",
    "How do I start learning to play the guitar?",
]


def input_grounded() -> list[str]:
    """User messages asking for a copy of a text with one change, paragraphs and code mixed."""
    out = []
    for paragraph, change, code, code_change in zip(
        PARAGRAPHS, PARAGRAPH_CHANGES, CODE, CODE_CHANGES, strict=True
    ):
        out.append(
            f"Rewrite the following paragraph, {change}. Change nothing else.\n\n{paragraph}"
        )
        out.append(f"Rewrite this Python code, {code_change}. Change nothing else.\n\n{code}")
    return out


def open_ended() -> list[str]:
    return list(OPEN_ENDED)
