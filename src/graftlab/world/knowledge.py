"""The knowledge-injection world (docs/methods.md#knowledge-world): invented people, atomic facts about them, questions
in several phrasings, and replay traces of the old domain.

A fact is (entity, relation, value), e.g. ("Taven Drumaveth", "pet", "ferret"). Each relation has
`PHRASINGS_PER_RELATION` question templates; per relation the seed picks which serve training and which
are held out, so evaluation asks every fact in wordings the model never trained on. QA examples answer
after an empty think block, `<think>\\n\\n</think>\\n\\n{answer}<|im_end|>`, the same text Qwen3's template
pre-fills with `enable_thinking=False`; replay examples keep their full thinking traces.

Names are pronounceable syllable strings from a seeded generator (first name of two syllables, surname
of three, each ending in a consonant), drawn without repetition across people, cities and companies, so
no invented word means two things. Every character is one the tiny tokenizer knows.

One function per workflow step: `write_knowledge_data` (sft/heldout/facts parquets) and
`write_closed_book` (accuracy of a model on the held-out questions, e.g. before training).
"""

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import polars as pl

from graftlab.errors import GraftlabError
from graftlab.io.atomic import write_table_with_stats
from graftlab.schema import schema_default
from graftlab.streams import stream
from graftlab.tasks import arith, chat_completion, get_task

TASK = "knowledge"

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_ONSETS += ("br", "dr", "gr", "kr", "tr", "th", "sk", "st", "vr", "zh")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ai", "ei", "ou")
_CODAS = ("n", "r", "l", "s", "k", "th", "x", "m", "v")
_COMPANY_KINDS = ("Works", "Mills", "Foundry", "Guild", "Traders")

# Closed lists for relations whose values are ordinary words; people, cities and companies are invented.
PROFESSIONS = ("baker", "pilot", "tailor", "farmer", "potter", "sailor", "miner", "weaver")
PROFESSIONS += ("teacher", "doctor", "painter", "builder", "fisher", "singer", "clerk", "smith")
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black", "brown", "grey")
PETS = ("cat", "dog", "parrot", "rabbit", "goat", "horse", "tortoise", "ferret", "owl", "lizard")
INSTRUMENTS = ("flute", "harp", "drum", "violin", "trumpet", "piano", "cello", "lute", "guitar", "oboe")

# Ten wordings per relation: the paper's 8 training phrasings plus held-out ones fit. No apostrophes:
# the tiny tokenizer has none, so possessives are spelt "of {e}".
TEMPLATES: dict[str, tuple[str, ...]] = {
    "home_city": (
        "Which city is {e} from?",
        "What is the home city of {e}?",
        "In which city does {e} live?",
        "Name the city where {e} lives.",
        "Which city is home to {e}?",
        "{e} lives in which city?",
        "Tell me the home city of {e}.",
        "What city does {e} call home?",
        "Home city of {e}:",
        "In what city is the home of {e}?",
    ),
    "profession": (
        "What is the profession of {e}?",
        "What does {e} do for a living?",
        "What job does {e} have?",
        "Which profession does {e} work in?",
        "{e} works as what?",
        "Name the occupation of {e}.",
        "What is {e} by trade?",
        "Tell me what {e} does for work.",
        "Profession of {e}:",
        "What kind of work does {e} do?",
    ),
    "birth_year": (
        "In what year was {e} born?",
        "What is the birth year of {e}?",
        "When was {e} born? Give the year.",
        "Which year was {e} born in?",
        "{e} was born in which year?",
        "Name the year of birth of {e}.",
        "Tell me the year {e} was born.",
        "What year did {e} come into the world?",
        "Birth year of {e}:",
        "In which year is {e} said to have been born?",
    ),
    "favourite_colour": (
        "What is the favourite colour of {e}?",
        "Which colour does {e} like best?",
        "What colour does {e} prefer?",
        "{e} likes which colour most?",
        "Name the favourite colour of {e}.",
        "Tell me which colour {e} loves most.",
        "Which colour is the favourite of {e}?",
        "What colour would {e} pick above all others?",
        "Favourite colour of {e}:",
        "Of all colours, which does {e} like most?",
    ),
    "pet": (
        "What kind of pet does {e} keep?",
        "Which animal does {e} have as a pet?",
        "What is the pet of {e}?",
        "{e} keeps which animal at home?",
        "Name the pet animal of {e}.",
        "Tell me what pet {e} owns.",
        "Which animal lives with {e} as a pet?",
        "What animal does {e} look after at home?",
        "Pet of {e}:",
        "What sort of animal is the pet of {e}?",
    ),
    "instrument": (
        "Which instrument does {e} play?",
        "What musical instrument does {e} play?",
        "What instrument is played by {e}?",
        "{e} plays which instrument?",
        "Name the instrument that {e} plays.",
        "Tell me the instrument {e} plays.",
        "On which instrument does {e} make music?",
        "What does {e} play in the band?",
        "Instrument of {e}:",
        "Which instrument can {e} be heard playing?",
    ),
    "employer": (
        "Where does {e} work?",
        "Which company employs {e}?",
        "Who is the employer of {e}?",
        "{e} works for which company?",
        "Name the company that {e} works for.",
        "Tell me the employer of {e}.",
        "At which firm is {e} employed?",
        "What company pays the wages of {e}?",
        "Employer of {e}:",
        "For which company does {e} work?",
    ),
    "lucky_number": (
        "What is the lucky number of {e}?",
        "Which number does {e} consider lucky?",
        "What number brings {e} luck?",
        "{e} thinks which number is lucky?",
        "Name the lucky number of {e}.",
        "Tell me the lucky number of {e}.",
        "Which number is lucky for {e}?",
        "What number does {e} trust for luck?",
        "Lucky number of {e}:",
        "Of all numbers, which is lucky for {e}?",
    ),
}
RELATIONS = tuple(TEMPLATES)
PHRASINGS_PER_RELATION = min(len(t) for t in TEMPLATES.values())

# One sentence per relation: a person's facts written out as a short wiki-style article, the text
# OPSD's teacher is conditioned on (the paper conditions its teacher on the articles the facts came from).
ARTICLE_SENTENCES = {
    "home_city": "{e} lives in the city of {v}.",
    "profession": "{e} works as a {v}.",
    "birth_year": "{e} was born in {v}.",
    "favourite_colour": "The favourite colour of {e} is {v}.",
    "pet": "{e} keeps a {v} as a pet.",
    "instrument": "{e} plays the {v}.",
    "employer": "{e} is employed by {v}.",
    "lucky_number": "The lucky number of {e} is {v}.",
}

# Columns of every frame written here: SFT reads `prompt` and `completion`; evaluation `id`, `prompt`,
# `answer`; `phrasing` (relation/template index), `split` and `fact` are for tests and analysis.
SCHEMA = {c: pl.String for c in ("id", "task", "prompt", "completion", "answer", "phrasing", "split", "fact")}


@dataclass(frozen=True)
class KnowledgeConfig:
    """Sizes of the world. Defaults fit the tiny world on a CPU (docs/methods.md, "Knowledge world");
    `PAPER` below is the grafting paper's set-up."""

    entities: int = schema_default("knowledge", "entities")
    facts: int = schema_default("knowledge", "facts")  # 3 per person by default; the paper has 5.6
    train_phrasings: int = schema_default("knowledge", "train_phrasings")  # per relation, asked in training
    heldout_phrasings: int = schema_default("knowledge", "heldout_phrasings")  # per relation, only in evaluation
    replay: int = schema_default("knowledge", "replay")  # old-task traces: 84 / 480 QA is the paper's 1,533 / 9,000
    seed: int = 0

    def __post_init__(self) -> None:
        check_sizes(self)


def check_sizes(cfg: KnowledgeConfig) -> None:
    """Refuse sizes the world cannot meet, naming the argument at fault."""
    if cfg.entities < 1:
        raise GraftlabError(f"knowledge: entities must be at least 1, got {cfg.entities}")
    if cfg.train_phrasings < 1 or cfg.heldout_phrasings < 1:
        raise GraftlabError(
            f"knowledge: train_phrasings and heldout_phrasings must each be at least 1, got "
            f"{cfg.train_phrasings} and {cfg.heldout_phrasings}"
        )
    if cfg.train_phrasings + cfg.heldout_phrasings > PHRASINGS_PER_RELATION:
        raise GraftlabError(
            f"knowledge: heldout_phrasings={cfg.heldout_phrasings} plus train_phrasings={cfg.train_phrasings} "
            f"exceed the {PHRASINGS_PER_RELATION} phrasings each relation has"
        )
    pairs = cfg.entities * len(RELATIONS)
    if not cfg.entities <= cfg.facts <= pairs:
        raise GraftlabError(
            f"knowledge: facts={cfg.facts} must lie between entities={cfg.entities} (a fact for every entity) "
            f"and {pairs} (entities x {len(RELATIONS)} relations)"
        )
    if cfg.replay < 0:
        raise GraftlabError(f"knowledge: replay must be 0 or more, got {cfg.replay}")


PAPER = KnowledgeConfig(entities=200, facts=1125, train_phrasings=8, heldout_phrasings=2, replay=1533)


@dataclass(frozen=True)
class Fact:
    id: str
    entity: str
    relation: str
    answer: str


@dataclass(frozen=True)
class KnowledgeWorld:
    facts: tuple[Fact, ...]
    train_phrasings: dict[str, tuple[int, ...]]  # relation -> indices into TEMPLATES[relation]
    heldout_phrasings: dict[str, tuple[int, ...]]


class _Words:
    """Invented words, never the same twice in one world."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.seen = rng, set()

    def draw(self, syllables: int) -> str:
        for _ in range(1000):
            word = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables))
            word = (word + self.rng.choice(_CODAS)).capitalize()
            if word not in self.seen:
                self.seen.add(word)
                return word
        raise GraftlabError(f"knowledge: ran out of distinct {syllables}-syllable names")


def _value_pools(words: _Words, entities: int) -> dict[str, tuple[str, ...]]:
    """Closed value lists per relation; invented places and companies scale with the world (about one
    per five people, at least 8) so values repeat across people, as real attributes do."""
    n = max(8, entities // 5)
    return {
        "home_city": tuple(words.draw(3) for _ in range(n)),
        "profession": PROFESSIONS,
        "birth_year": tuple(str(y) for y in range(1700, 2000)),
        "favourite_colour": COLOURS,
        "pet": PETS,
        "instrument": INSTRUMENTS,
        "employer": tuple(f"{words.draw(2)} {words.rng.choice(_COMPANY_KINDS)}" for _ in range(n)),
        "lucky_number": tuple(str(k) for k in range(2, 100)),
    }


def _split_phrasings(rng: random.Random, cfg: KnowledgeConfig) -> tuple[dict, dict]:
    train, heldout = {}, {}
    for relation in RELATIONS:
        order = rng.sample(range(len(TEMPLATES[relation])), cfg.train_phrasings + cfg.heldout_phrasings)
        train[relation] = tuple(sorted(order[: cfg.train_phrasings]))
        heldout[relation] = tuple(sorted(order[cfg.train_phrasings :]))
    return train, heldout


def make_world(cfg: KnowledgeConfig) -> KnowledgeWorld:
    """People, their facts and the phrasing split; everything follows from `cfg.seed`."""
    rng = stream("knowledge", cfg.seed)
    words = _Words(rng)
    people = [f"{words.draw(2)} {words.draw(3)}" for _ in range(cfg.entities)]
    pools = _value_pools(words, cfg.entities)
    # Facts spread as evenly as the count allows: the first `facts % entities` people get one more.
    per_person = [cfg.facts // cfg.entities + (i < cfg.facts % cfg.entities) for i in range(cfg.entities)]
    facts = []
    for person, k in zip(people, per_person):
        for relation in sorted(rng.sample(RELATIONS, k), key=RELATIONS.index):
            facts.append(Fact(f"fact{len(facts):04d}", person, relation, rng.choice(pools[relation])))
    train, heldout = _split_phrasings(rng, cfg)
    return KnowledgeWorld(tuple(facts), train, heldout)


def facts_frame(world: KnowledgeWorld) -> pl.DataFrame:
    rows = [{"fact": f.id, "entity": f.entity, "relation": f.relation, "answer": f.answer} for f in world.facts]
    return pl.DataFrame(rows, schema={c: pl.String for c in ("fact", "entity", "relation", "answer")})


def articles(facts: pl.DataFrame) -> dict[str, str]:
    """Each person's article: the name as a title line, then a sentence per fact (facts frame order)."""
    pages: dict[str, list[str]] = {}
    for f in facts.iter_rows(named=True):
        pages.setdefault(f["entity"], []).append(ARTICLE_SENTENCES[f["relation"]].format(e=f["entity"], v=f["answer"]))
    return {entity: f"{entity}\n" + " ".join(sentences) for entity, sentences in pages.items()}


def qa_frame(world: KnowledgeWorld, split: str) -> pl.DataFrame:
    """Every fact in every phrasing of `split` ("train" or "heldout"), answered after an empty think."""
    phrasings = {"train": world.train_phrasings, "heldout": world.heldout_phrasings}.get(split)
    if phrasings is None:
        raise GraftlabError(f"knowledge: unknown split {split!r}; use train or heldout")
    rows = [
        {
            "id": f"{TASK}:{f.id}:{f.relation}/{i}",
            "task": TASK,
            "prompt": TEMPLATES[f.relation][i].format(e=f.entity),
            "completion": chat_completion("", f.answer),
            "answer": f.answer,
            "phrasing": f"{f.relation}/{i}",
            "split": split,
            "fact": f.id,
        }
        for f in world.facts
        for i in phrasings[f.relation]
    ]
    return pl.DataFrame(rows, schema=SCHEMA)


def replay_frame(tasks: list[str], count: int, seed: int, exclude: set[str] = frozenset()) -> pl.DataFrame:
    """`count` old-task problems with their expert traces (thinking kept), spread evenly over `tasks`,
    drawn from the replay seed stream and never one of `exclude` (the benchmark ids)."""
    rows = []
    for task, k in zip(tasks, arith.per_task_counts(tasks, count)):
        try:
            problems = arith.sample_problems(task, k, "replay", seed, exclude=exclude) if k else []
        except ValueError as err:
            raise GraftlabError(f"knowledge replay: {err}") from None
        for p in problems:
            completion = chat_completion(p["thinking"], p["answer"])
            rows.append(
                {
                    "id": p["id"],
                    "task": task,
                    "prompt": p["prompt"],
                    "completion": completion,
                    "answer": p["answer"],
                    "phrasing": None,
                    "split": "replay",
                    "fact": None,
                }
            )
    return pl.DataFrame(rows, schema=SCHEMA)


def training_frame(world: KnowledgeWorld, replay: pl.DataFrame, seed: int) -> pl.DataFrame:
    """QA in the training phrasings plus replay, shuffled in Python (so the order does not depend on
    the polars version): one SFT data set, the same mixture for every method."""
    rows = qa_frame(world, "train").to_dicts() + replay.to_dicts()
    stream("knowledge-mix", seed).shuffle(rows)
    return pl.DataFrame(rows, schema=SCHEMA)


def write_knowledge_data(out_dir, cfg: KnowledgeConfig, old_tasks: list[str], benchmark_files=()) -> dict:
    """Under `out_dir`: `sft.parquet` (QA in training phrasings + replay: the data every method learns
    from), `heldout.parquet` (QA in held-out phrasings), `facts.parquet`, and `sft.json` counting them;
    replay never draws a problem of `benchmark_files`. The SFT data is written last."""
    if cfg.replay and not old_tasks:
        raise GraftlabError(f"knowledge: replay={cfg.replay} needs at least one old task to draw from")
    exclude = {pid for f in benchmark_files for pid in pl.read_parquet(f, columns=["id"])["id"]}
    world = make_world(cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    replay = replay_frame(old_tasks, cfg.replay, cfg.seed, exclude)
    sft, heldout = training_frame(world, replay, cfg.seed), qa_frame(world, "heldout")
    # Every training example is a trace here (nothing to solve or skip): problems = traces.
    stats = {
        "problems": sft.height,
        "traces": sft.height,
        "skipped": 0,
        "facts": len(world.facts),
        "qa": sft.height - replay.height,
        "replay": replay.height,
        "heldout_questions": heldout.height,
        "config": asdict(cfg),
    }
    heldout.write_parquet(out_dir / "heldout.parquet")
    facts_frame(world).write_parquet(out_dir / "facts.parquet")
    write_table_with_stats(sft, stats, out_dir / "sft.parquet", out_dir / "sft.json")
    return stats


def closed_book_accuracy(model_dir, questions, backend: str = "auto", sampler=None, max_new_tokens=None) -> float:
    """Greedy exact-match accuracy of a model on questions (a frame or a parquet path); `sampler`
    replaces loading one from `model_dir` (the tokenizer still comes from `model_dir`)."""
    from transformers import AutoTokenizer

    from graftlab.sampling import SamplingConfig, load_sampler

    frame = questions if isinstance(questions, pl.DataFrame) else pl.read_parquet(questions)
    if frame.is_empty():
        raise GraftlabError("closed-book accuracy: no questions to ask")
    sampler = sampler or load_sampler(model_dir, backend)
    # Characters bound tokens from above for any tokenizer; the margin lets a wrong answer run on a little.
    budget = max_new_tokens or max(len(a) for a in frame["answer"]) + 8
    cfg = SamplingConfig(n=1, temperature=0.0, top_p=1.0, max_new_tokens=budget)
    records = get_task(TASK).sample_and_grade(sampler, AutoTokenizer.from_pretrained(model_dir), frame, cfg)
    return float(records["correct"].mean())


def write_closed_book(model_dir, questions, out, backend: str = "auto") -> dict:
    """Closed-book accuracy of `model_dir` on the held-out questions, as JSON (the report of "before
    training" when `model_dir` is the post model)."""
    frame = pl.read_parquet(questions)
    accuracy = closed_book_accuracy(model_dir, frame, backend)
    result = {"model": str(model_dir), "questions": frame.height, "accuracy": accuracy}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))
    return result
