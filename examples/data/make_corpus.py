#!/usr/bin/env python3
"""Writes corpus.txt, the text examples/train_gpt learns by default: short fables generated from a
small grammar with a fixed seed, so the project ships its own data and anyone can regenerate it.
Run: python3 make_corpus.py > corpus.txt"""
import random

rng = random.Random(2026)
animals = ["fox", "crow", "hare", "tortoise", "lion", "mouse", "wolf", "lamb", "ant", "grasshopper",
           "owl", "goat", "frog", "stork", "heron", "cat", "dog", "horse", "donkey", "bear"]
adjectives = ["clever", "proud", "hungry", "tired", "old", "young", "quick", "slow", "wise", "foolish",
              "kind", "greedy", "brave", "timid", "patient", "busy", "lazy", "honest", "sly", "gentle"]
places = ["by the river", "in the forest", "on the hill", "near the farm", "under the oak tree",
          "beside the well", "in the meadow", "at the edge of the field", "by the old mill", "in the valley"]
things = ["a piece of cheese", "a bunch of grapes", "a golden egg", "a heavy stone", "a sweet apple",
          "a loaf of bread", "a shiny coin", "a basket of corn", "a jar of honey", "a long rope"]
verbs_past = ["found", "wanted", "carried", "hid", "shared", "lost", "guarded", "stole", "offered", "dropped"]
morals = ["Slow and steady wins the race.", "Pride comes before a fall.", "A friend in need is a friend indeed.",
          "Do not count your chickens before they hatch.", "Look before you leap.",
          "Kindness is never wasted.", "Greed often overreaches itself.", "Honesty is the best policy.",
          "Little by little does the trick.", "It is wise to prepare for the days of need."]
sayings = ["said", "asked", "cried", "whispered", "laughed", "answered", "shouted", "replied"]


def name():
    return f"the {rng.choice(adjectives)} {rng.choice(animals)}"


def sentence():
    a, b = name(), name()
    forms = [
        lambda: f"One day {a} {rng.choice(verbs_past)} {rng.choice(things)} {rng.choice(places)}.",
        lambda: f"{a.capitalize()} met {b} {rng.choice(places)}.",
        lambda: f"\"Why do you look so sad?\" {rng.choice(sayings)} {a}.",
        lambda: f"\"I have {rng.choice(things)},\" {rng.choice(sayings)} {b}, \"and I will not give it away.\"",
        lambda: f"So {a} waited {rng.choice(places)} until the sun went down.",
        lambda: f"But {b} was not as {rng.choice(adjectives)} as it seemed.",
        lambda: f"In the end {a} {rng.choice(verbs_past)} {rng.choice(things)} and went home.",
        lambda: f"{a.capitalize()} and {b} worked together all summer long.",
    ]
    return rng.choice(forms)()


def fable(n):
    title = f"{n}. The {rng.choice(animals).capitalize()} and the {rng.choice(animals).capitalize()}"
    body = " ".join(sentence() for _ in range(rng.randint(4, 8)))
    return f"{title}\n\n{body}\nMoral: {rng.choice(morals)}\n"


if __name__ == "__main__":
    print("\n".join(fable(i + 1) for i in range(600)))
