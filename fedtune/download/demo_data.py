"""Deterministic text for the demo's two sites, whose styles differ at a glance: `alpha` writes English
kitchen recipes, `beta` writes Italian weather bulletins. The files in data/demo are this module's output
(`python -m fedtune.download.demo_data data/demo`); a test checks that they still are."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from fedtune.core import cli

RECIPE = {
    "dish": ["soup", "stew", "risotto", "pie", "salad", "curry", "bread", "omelette", "pasta", "tart"],
    "main": ["lentils", "mushrooms", "chicken", "beans", "potatoes", "spinach", "pumpkin", "leeks", "rice"],
    "herb": ["thyme", "basil", "parsley", "rosemary", "sage", "coriander", "dill", "mint"],
    "verb": ["chop", "slice", "dice", "stir", "fold", "whisk", "simmer", "roast", "season", "drain"],
    "vessel": ["pan", "pot", "bowl", "tray", "skillet", "dish"],
    "time": ["five", "ten", "fifteen", "twenty", "thirty", "forty"],
    "adj": ["golden", "tender", "soft", "crisp", "fragrant", "thick", "smooth"],
}

METEO = {
    "citta": ["Roma", "Milano", "Napoli", "Torino", "Bologna", "Firenze", "Bari", "Palermo", "Genova"],
    "cielo": ["sereno", "nuvoloso", "coperto", "poco nuvoloso", "variabile", "nebbioso"],
    "fenomeno": ["pioggia", "temporali", "neve", "vento forte", "grandine", "foschia"],
    "parte": ["mattina", "pomeriggio", "sera", "notte"],
    "vento": ["deboli", "moderati", "forti", "tesi"],
    "direzione": ["nord", "sud", "est", "ovest", "nord-est", "sud-ovest"],
    "mare": ["calmo", "poco mosso", "mosso", "agitato"],
}


def recipe(rng: random.Random) -> str:
    pick = {k: rng.choice(v) for k, v in RECIPE.items()}
    steps = []
    for i in range(rng.randint(3, 6)):
        verb = rng.choice(RECIPE["verb"])
        item = rng.choice(RECIPE["main"] + RECIPE["herb"])
        minutes = rng.choice(RECIPE["time"])
        steps.append(
            f"Step {i + 1}: {verb} the {item} for {minutes} minutes until {rng.choice(RECIPE['adj'])}."
        )
    return (
        f"Recipe: {pick['adj']} {pick['main']} {pick['dish']} with {pick['herb']}. "
        f"Serves {rng.randint(2, 8)}. Heat a {pick['vessel']}. " + " ".join(steps) + " Serve warm."
    )


def bulletin(rng: random.Random) -> str:
    parts = []
    for city in rng.sample(METEO["citta"], rng.randint(2, 4)):
        low = rng.randint(-3, 15)
        parts.append(
            f"A {city} cielo {rng.choice(METEO['cielo'])} in {rng.choice(METEO['parte'])}, "
            f"possibili {rng.choice(METEO['fenomeno'])}; temperature tra {low} e {low + rng.randint(4, 14)} gradi."
        )
    return (
        "Bollettino meteo. " + " ".join(parts) + f" Venti {rng.choice(METEO['vento'])} da "
        f"{rng.choice(METEO['direzione'])}, mare {rng.choice(METEO['mare'])}."
    )


SITES = {"alpha": recipe, "beta": bulletin}
SIZES = {"train": 1600, "test": 200}

# Reviews for the classification demo: the class is the tone of the verdict (0 negative, 1 mixed,
# 2 positive); the sites review different things, so each site's model knows its own vocabulary best.
TONES = {
    0: ["awful", "bland", "disappointing", "dreadful", "cold"],
    1: ["average", "acceptable", "ordinary", "uneven", "passable"],
    2: ["excellent", "delicious", "wonderful", "superb", "lovely"],
}
REVIEWED = {
    "alpha": ("restaurant", RECIPE["dish"], RECIPE["main"]),
    "beta": ("hotel", ["room", "breakfast", "view", "staff", "pool", "terrace"], METEO["citta"]),
}
REVIEW_SIZES = {"train": 480, "test": 120}


def review(rng: random.Random, site: str) -> dict:
    place, things, extras = REVIEWED[site]
    label = rng.randrange(len(TONES))
    thing, extra = rng.choice(things), rng.choice(extras)
    filler = f"We visited the {place} on a {rng.choice(['Monday', 'Friday', 'Sunday'])} with {extra}."
    verdict = f"The {thing} was {rng.choice(TONES[label])}."
    parts = [filler, verdict] if rng.random() < 0.5 else [verdict, filler]
    return {"text": " ".join(parts), "label": label}


def write_reviews(out_dir: str | Path, seed: int = 0) -> list[Path]:
    """<site>/{train,test}.jsonl with text and label columns, for task sequence-classification."""
    written = []
    for site_index, site in enumerate(REVIEWED):
        for split_index, (split, count) in enumerate(REVIEW_SIZES.items()):
            rng = random.Random(seed * 1000 + site_index * 10 + split_index + 500)
            path = Path(out_dir) / site / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                for _ in range(count):
                    f.write(json.dumps(review(rng, site)) + "\n")
            written.append(path)
    return written


def write(out_dir: str | Path, seed: int = 0) -> list[Path]:
    written = []
    for site_index, (site, make) in enumerate(SITES.items()):
        for split_index, (split, count) in enumerate(SIZES.items()):
            rng = random.Random(seed * 1000 + site_index * 10 + split_index)
            path = Path(out_dir) / site / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                for _ in range(count):
                    f.write(json.dumps({"text": make(rng)}, ensure_ascii=False) + "\n")
            written.append(path)
    return written


@cli.entry("fedtune.download.demo_data")
def main(argv=None) -> None:
    parser = cli.parser("fedtune.download.demo_data", __doc__)
    parser.add_argument("out_dir", help="folder to write <site>/{train,test}.jsonl into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reviews", action="store_true", help="labelled reviews (text, label) for sequence-classification"
    )
    args = parser.parse_args(argv)
    for path in (write_reviews if args.reviews else write)(args.out_dir, args.seed):
        print(path)


if __name__ == "__main__":
    sys.exit(main())
