"""The workflow configuration: validation against `src/graftlab/config.schema.yaml` and its defaults.

The schema is the only place defaults live. jsonschema validates but does not fill defaults, so the
`properties` keyword is extended to insert them before descending (the recipe from jsonschema's FAQ).
"""

import copy
import json
import math
import re
from functools import cache

from jsonschema import Draft202012Validator, validators

from graftlab.errors import GraftlabError
from graftlab.io.gates import MAX_LR
from graftlab.methods import METHODS, on_policy, sections, specs
from graftlab.methods.sdpo import DENSITY_KEYS, SdpoSpec, parse_schedule
from graftlab.methods.spec import holes
from graftlab.planning.chains import is_continual, stage_data_kind
from graftlab.planning.layout import WORLD_LADDERS, world_checkpoint
from graftlab.schema import load_schema, shipped_schema


class ConfigError(ValueError):
    """A configuration problem, named by its key path."""


def _with_defaults(base):
    check_properties = base.VALIDATORS["properties"]

    def properties(validator, props, instance, schema):
        if isinstance(instance, dict):
            for key, sub in props.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from check_properties(validator, props, instance, schema)

    return validators.extend(base, {"properties": properties})


@cache
def _validator(section: str):
    """The defaults-filling validator of the whole config (`section` "") or of one `$defs` section, made
    once a process, on the schema read once (`shipped_schema`): a validator keeps the `$ref`s it has
    resolved. Reading the schema and making a validator at every call took resolve() from 31 to 48 ms on
    configs/smoke.yaml, 21 to 59 on config.yaml (EPYC-AVX2), and the tests resolve thousands of configs."""
    schema = shipped_schema()
    return _with_defaults(Draft202012Validator)(
        {"$defs": schema["$defs"], "$ref": f"#/$defs/{section}"} if section else schema
    )


def resolve(config: dict) -> dict:
    """Validate `config` in place, fill in every default, and return it.

    Each named world of `worlds` becomes a whole world section (merged over `world`, with its seed), and
    every experiment gets its seed and its study group (its own name by default), so the rules read one
    resolved value each. Resolving a resolved
    config changes nothing. Raises ConfigError with one line naming the offending key.
    """
    schema = shipped_schema()
    _refuse_nonfinite(config, ())
    _validate(config, "", ())
    _resolve_worlds(config)
    for name, exp in config["experiments"].items():
        if exp["seed"] is None:
            exp["seed"] = config["seed"]
        if exp["group"] is None:
            exp["group"] = name
    _check_semantics(config, schema)
    return config


# The largest integer a job reads as one (torch, numpy, safetensors: int64); a larger one overflows there.
_INT64 = 2**63 - 1


def _refuse_nonfinite(value, path: tuple) -> None:
    """Every number of the config, wherever it lies, is finite and fits 64 bits, whatever its schema says:
    NaN compares false, so it passes `minimum` and `maximum` alike, and an infinity passes `minimum`
    (YAML writes them `.nan`, `.inf`, `-.inf`). No setting means one, and a job would fail hours in, or
    train on NaN. Run before the schema, so the message says what is wrong rather than a bound."""
    if isinstance(value, dict):
        for key, sub in value.items():
            _refuse_nonfinite(sub, (*path, key))
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            _refuse_nonfinite(sub, (*path, i))
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key {_where(path)}: {value} is not a finite number; no setting takes NaN or Inf")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > _INT64:
        raise ConfigError(f"config key {_where(path)}: {value} does not fit the 64-bit integers the jobs read it as")


def _where(path: tuple) -> str:
    return ".".join(map(str, path)) or "(top level)"


def _validate(instance: dict, section: str, prefix: tuple) -> None:
    """Fill `instance`'s defaults and raise the most relevant error, its key path after `prefix`: against
    the whole schema (`section` "") or its `$defs` section."""
    validator = _validator(section)
    # Fill defaults first (a full pass), then report the most relevant error, if any.
    errors = sorted(validator.iter_errors(instance), key=lambda e: (len(e.path), list(map(str, e.path))))
    if not errors:
        return
    err = errors[0]
    # "not valid under any of the given schemas" names no key: a nullable section (`oneOf` null or an
    # object) reports what is wrong inside the object instead.
    while err.context:
        err = max(err.context, key=lambda e: (e.validator != "type", len(e.absolute_path)))
    where = ".".join(map(str, [*prefix, *err.absolute_path])) or "(top level)"
    # A regex says little to a researcher; the schema's description of the value says what is wanted.
    message = err.message
    if err.validator in ("pattern", "not") and "description" in err.schema:
        message = f"{err.instance!r} is invalid: {err.schema['description']}"
    raise ConfigError(f"config key {where}: {message}")


def _resolve_worlds(config: dict) -> None:
    """Replace each partial section of `worlds` by the whole world it names: laid over `world`, checked
    by the same world schema (so an unknown key is an error under `worlds.<name>`), seed filled in."""
    for name, partial in config["worlds"].items():
        partial = dict(partial)
        seed = partial.pop("seed", None)
        world = _deep_merge(config["world"], partial)
        _validate(world, "world", ("worlds", name))
        config["worlds"][name] = world | {"seed": config["seed"] if seed is None else seed}


def _deep_merge(base: dict, over: dict) -> dict:
    """`over` laid on a copy of `base`: maps merge key by key; lists and values replace."""
    merged = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _check_semantics(config: dict, schema: dict) -> None:
    """What a schema cannot say: cross-references between keys, and limits of the tiny world."""
    # One walk of the config beside its schema serves every check of a kind the schema marks; the named
    # worlds are whole `world` sections by now, which `worlds.<name>` in the schema does not describe.
    world_schema = {"$ref": "#/$defs/world"}
    nodes = list(_schema_nodes(config, schema, schema["$defs"], ()))
    for name, world in config["worlds"].items():
        nodes += _schema_nodes(world, world_schema, schema["$defs"], ("worlds", name))
    checks = _name_checks(config, schema, nodes) + _spelling_checks(nodes, schema["$defs"])
    checks += _world_checks(config["world"], "world")
    for name, world in config["worlds"].items():
        checks += _world_checks(world, f"worlds.{name}")
    checks += _unread_world_options(config, schema)
    for name, exp in config["experiments"].items():
        checks += _experiment_checks(config, exp, f"experiments.{name}")
        checks += _unread_options(exp, f"experiments.{name}", schema)
    checks += _duplicate_models(config["models"])
    unknown = [e for e in config["study"]["experiments"] or [] if e not in config["experiments"]]
    checks.append((not unknown, "study.experiments", f"{unknown} are not in `experiments`"))
    for ok, where, problem in checks:
        if not ok:
            raise ConfigError(f"config key {where}: {problem}")


def _schema_nodes(instance, schema: dict, defs: dict, path: tuple):
    """(key path, value, its schema) of `instance` and of everything inside it that its schema describes:
    a `$ref` resolved (the keywords beside it kept), a nullable section's branch chosen by its value."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]] | {k: v for k, v in schema.items() if k != "$ref"}
    if "oneOf" in schema:
        branch = [b for b in schema["oneOf"] if (b.get("type") == "null") == (instance is None)]
        if branch:
            yield from _schema_nodes(instance, branch[0], defs, path)
        return
    yield path, instance, schema
    if isinstance(instance, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, value in instance.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                yield from _schema_nodes(value, sub, defs, (*path, key))
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for i, value in enumerate(instance):
            yield from _schema_nodes(value, schema["items"], defs, (*path, i))


# The longest name a map of names takes: a file system's limit is 255 bytes a path component, and some
# components add to the name (`logs/models/{name}.log`, `benchmark~{name}.parquet`).
_NAME_MAX = 100


def _name_checks(config: dict, schema: dict, nodes: list) -> list[tuple[bool, str, str]]:
    """Names that become directories (experiments, worlds, models, benchmarks: every map of the schema
    whose keys a `propertyNames` rule spells) are at most `_NAME_MAX` characters and distinct in any
    letter case, since a case-insensitive file system (macOS's, Windows') holds one directory for both;
    and no experiment takes, in any case, a directory the workflow writes for itself beside the
    experiments' (the schema's reserved names)."""
    checks = []
    for path, value, sub in nodes:
        if "propertyNames" not in sub or not isinstance(value, dict):
            continue
        long = [name for name in value if len(str(name)) > _NAME_MAX]
        checks.append((not long, _where(path), f"{long} exceed {_NAME_MAX} characters, too long a directory name"))
        folded: dict[str, list[str]] = {}
        for name in value:
            folded.setdefault(str(name).casefold(), []).append(str(name))
        for names in folded.values():
            checks.append(
                (
                    len(names) == 1,
                    _where(path),
                    f"{names} differ only in letter case: one directory on a case-insensitive file system",
                )
            )
    names = schema["properties"]["experiments"]["propertyNames"]
    reserved = {r.casefold(): r for r in names.get("not", {}).get("enum", [])}
    for name in config["experiments"]:
        own = reserved.get(name.casefold())
        checks.append(
            (
                own is None,
                "experiments",
                f"{name!r} is {own!r} in another letter case, a directory the workflow writes under results/ "
                "for itself (one directory on a case-insensitive file system): rename the experiment",
            )
        )
    return checks


# A number inside a spelled value ("1e-3", the R of "ema:0.05", the N of "post~48"): the fields of a value
# are split at `~` and `:`, and a field that is wholly a number is one.
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:[eE]-?[0-9]+)?")
_FIELDS = re.compile(r"([~:])")


def _spelled_value(text: str, kind: str) -> tuple:
    """What a spelled value means, the same for every spelling of it: its numeric fields as floats, and for
    a teacher schedule its parsed form (`refresh:0.5` is `refresh:0.5:1`, gamma defaulting to 1)."""
    if kind == "teacher":
        try:
            return tuple(parse_schedule(text))
        except GraftlabError:
            pass  # its own check names what is wrong; its fields still say whether it is finite
    return tuple(float(f) if _NUMBER.fullmatch(f) else f for f in _FIELDS.split(text))


def _spelling_checks(nodes: list, defs: dict) -> list[tuple[bool, str, str]]:
    """Every list whose items a pattern spells (sweeps written as strings, "1e-3"; teacher schedules;
    donors such as `post~48`), found by walking the schema: its numbers finite ("1e400" passes the
    pattern and is Inf), and no value in it twice under two spellings ("1e-3", "0.001"), which would name
    the same runs twice. Strings keep their spelling because result paths do."""
    checks = []
    for path, value, sub in nodes:
        items = sub.get("items")
        if not isinstance(value, list) or not isinstance(items, dict):
            continue
        kind = items.get("$ref", "").rsplit("/", 1)[-1]
        spelled = defs[kind] if kind else items
        if "pattern" not in spelled or spelled.get("type") != "string":
            continue
        values = [_spelled_value(v, kind) for v in value]
        where = _where(path)
        infinite = [v for v, x in zip(value, values) if any(isinstance(f, float) and math.isinf(f) for f in x)]
        checks.append((not infinite, where, f"{infinite} are not finite numbers"))
        twice = sorted({v for v, x in zip(value, values) if values.count(x) > 1})
        checks.append((not twice, where, f"{twice} are one value spelled twice: the same runs would be trained twice"))
    return checks


def _default_of(schema: dict, dotted: str):
    """The schema's default of the experiment key `dotted` (`graft.masks.rho`)."""
    defs, sub = schema["$defs"], schema["$defs"]["experiment"]
    for part in dotted.split("."):
        sub = sub["properties"][part]
        if "$ref" in sub:
            sub = defs[sub["$ref"].rsplit("/", 1)[1]] | {k: v for k, v in sub.items() if k != "$ref"}
    return sub["default"]


def _keys_of(schema: dict, section: str) -> list[str]:
    """Every key of the experiment's `section` (`star`), dotted (`star.attempts`)."""
    defs, sub = schema["$defs"], schema["$defs"]["experiment"]["properties"][section]
    if "$ref" in sub:
        sub = defs[sub["$ref"].rsplit("/", 1)[1]]
    return [f"{section}.{key}" for key in sub["properties"]]


def _unread_options(exp: dict, key: str, schema: dict) -> list[tuple[bool, str, str]]:
    """Options set (other than the schema's default) where nothing reads them, because the option they
    depend on is off: whoever sets one expects an effect there is none of. Compared with the default, not
    with what the file spells, so a resolved config resolves again unchanged.

    Whole data-setting sections (`star`, `mining`, `knowledge`, `pedagogical`) are not refused where their
    setting is off: the presets share them between experiments by a YAML merge key (configs/smoke.yaml's
    `<<: *shared`), so there an unread one is inherited, not meant."""
    continual, data = is_continual(exp), exp["data"]
    stages = f"{key}.stages make a continual experiment, whose stages make their own data"
    # (options, whether anything reads them, why not): where each is read is named beside it.
    rules: list[tuple[list[str], bool, str]] = []
    grafts = list(dict.fromkeys(m.section for m in METHODS.values() if m.grafts))
    for section in grafts:  # graftlab.planning.layout.graft_keys and chains: masked runs iterate the kinds
        masked = [f"{section}.masks.{k}" for k in ("rho", "scope", "score", "lam", "epochs")]
        rules.append((masked, bool(exp[section]["masks"]["kinds"]), f"{key}.{section}.masks.kinds is empty"))
    kinds = ", ".join(f"{key}.{section}.masks.kinds" for section in grafts)
    kfac = any("kfac" in exp[section]["masks"]["kinds"] for section in grafts)  # layout.fisher_name
    rules.append((["fisher.ekfac", "fisher.kfac_positions"], kfac, f"no mask kind is kfac ({kinds})"))
    # rules/synth.smk's teacher_traces takes the single-domain experiments of data: teacher only.
    why = stages if continual else f"{key}.data is {data!r}, not teacher"
    rules.append((["teacher.model"], not continual and data == "teacher", why))
    star = ["star.rationalize_attempts"]  # graftlab.synth.star: the hinted attempts follow only with it
    rules.append((star, exp["star"]["rationalize"], f"{key}.star.rationalize is false"))
    # The schema's `stages`: a continual experiment ignores `data`, `problems` and `mining`
    # (rules/data.smk's rules take single-domain experiments only).
    rules.append((["data", "problems", *_keys_of(schema, "mining")], not continual, stages))
    rules.append((_keys_of(schema, "continual"), continual, f"{key}.stages is empty"))
    # rules/graft.smk screens a single-domain experiment's grafts on the validation problems only.
    rules.append((["eval.adaptive"], not continual, stages))
    rules.append((["eval.adaptive"], exp["eval"]["validation"] > 0, f"{key}.eval.validation is 0 (it screens on them)"))
    rules.append((["eval.adaptive_checkpoints"], exp["eval"]["adaptive"] > 0, f"{key}.eval.adaptive is 0"))
    # An on-policy section whose sweeps name no run trains nothing, so none of its settings is read. Its
    # sweep axes (the lists) are the switch itself, and stay as a preset left them.
    for section in sections(on_policy()):
        runs = [r for m in on_policy() if m.section == section for r in m.spec.runs(exp[section])]
        settings = [k for k in _keys_of(schema, section) if not isinstance(_value_at(exp, k), list)]
        rules.append((settings, bool(runs), f"{key}.{section} sweeps no run"))
    for m in on_policy():  # SDPO's two densities each read their own switches (graftlab.methods.sdpo.run_density)
        if isinstance(m.spec, SdpoSpec):
            switches = [f"{m.section}.{k}" for k in DENSITY_KEYS[m.spec.cot]]
            why = f"{key}.{m.section}.{m.spec.teachers} is empty"
            rules.append((switches, bool(exp[m.section][m.spec.teachers]), why))
    checks = []
    for options, read, why in rules:
        for option in options if not read else ():
            set_ = _value_at(exp, option) != _default_of(schema, option)
            checks.append((not set_, f"{key}.{option}", f"is set but {why}: it would be ignored"))
    knowledge = {k.split(".", 1)[1]: _default_of(schema, k) for k in _keys_of(schema, "knowledge")}
    for i, stage in enumerate(exp["stages"]):  # rules/continual.smk: a knowledge stage's world only
        kind = stage_data_kind(stage)
        set_ = kind != "knowledge" and stage["knowledge"] != knowledge
        why = f"is set but stage {i} is no knowledge stage (its data: {kind}): it would be ignored"
        checks.append((not set_, f"{key}.stages.{i}.knowledge", why))
    # graftlab.analysis.screen: a screening scores problems the reported (test) scores never see.
    screen, validation = exp["eval"]["adaptive"], exp["eval"]["validation"]
    why = f"is {screen:g}, above {key}.eval.validation ({validation:g}): it would screen on test problems"
    checks.append((not validation or screen <= validation, f"{key}.eval.adaptive", why))
    return checks


def _value_at(section: dict, dotted: str):
    for part in dotted.split("."):
        section = section[part]
    return section


def _unread_world_options(config: dict, schema: dict) -> list[tuple[bool, str, str]]:
    """A world's `corpus.new_task_problems` is only read with `corpus.new_task_share` > 0 (graftlab.world's
    corpus). The main `world` lends its keys to every named world: there it is read when any world that
    keeps its value reads it; a named world's value equal to the main one's is inherited, not set."""
    default = schema["$defs"]["world"]["properties"]["corpus"]["properties"]["new_task_problems"]["default"]
    main = config["world"]["corpus"]["new_task_problems"]
    sections = {"world": config["world"]} | {f"worlds.{n}": w for n, w in config["worlds"].items()}
    checks = []
    for where, world in sections.items():
        corpus = world["corpus"]
        if where == "world":
            keeping = [w for w in sections.values() if w["corpus"]["new_task_problems"] == main]
            read = any(w["corpus"]["new_task_share"] > 0 for w in keeping)
            set_ = main != default
        else:
            read, set_ = corpus["new_task_share"] > 0, corpus["new_task_problems"] not in (default, main)
        why = f"is set but {where}.corpus.new_task_share is 0: it would be ignored"
        checks.append((read or not set_, f"{where}.corpus.new_task_problems", why))
    return checks


def _duplicate_models(models: dict) -> list[tuple[bool, str, str]]:
    """Two names for one checkpoint (the same source, revision and every other field but the `params` hint):
    each job of one would repeat the other's, a donor's SFT and grafts and their evaluations among them."""
    import json

    first: dict[str, str] = {}
    checks = []
    for name, model in models.items():
        same = json.dumps({k: v for k, v in model.items() if k != "params"}, sort_keys=True, default=str)
        if same in first:
            problem = f"is models.{first[same]} again (source {model['source']!r}, revision {model.get('revision')!r})"
            checks.append((False, f"models.{name}", problem + ": give each its own revision, or drop one"))
        first.setdefault(same, name)
        # rules/common.smk's rope_dir: another model's fetched directory, which nothing fetches otherwise.
        rope = model.get("rope_from")
        known = rope is None or (rope in models and rope != name)
        checks.append((known, f"models.{name}.rope_from", f"{rope!r} is no other name in models {sorted(models)}"))
    return checks


def _world_checks(world: dict, key: str) -> list[tuple[bool, str, str]]:
    from graftlab.tasks.arith import distinct_problems
    from graftlab.world import posttrain_steps

    ladder, steps = world["pretrain"]["ladder"], world["pretrain"]["steps"]
    post_ladder, post_steps = world["posttrain"]["ladder"], posttrain_steps(world)
    model, distinct = world["model"], distinct_problems(world["new_task"])
    checks = [
        (
            ladder == sorted(ladder) and ladder[-1] == steps,
            f"{key}.pretrain.ladder",
            f"must increase and end at step {steps} (the base model)",
        ),
        (
            post_ladder == sorted(post_ladder) and all(s < post_steps for s in post_ladder),
            f"{key}.posttrain.ladder",
            f"must increase and stay below post-training's {post_steps} steps (the post model itself is `post`)",
        ),
        (
            model["heads"] % model["kv_heads"] == 0,
            f"{key}.model.kv_heads",
            f"must divide {key}.model.heads = {model['heads']}",
        ),
        (
            model["hidden_size"] % model["heads"] == 0,
            f"{key}.model.heads",
            f"must divide {key}.model.hidden_size = {model['hidden_size']}",
        ),
        (
            world["corpus"]["block"] <= model["max_positions"],
            f"{key}.corpus.block",
            f"exceeds {key}.model.max_positions = {model['max_positions']}",
        ),
        (
            world["candidates"] <= distinct,
            f"{key}.candidates",
            f"exceeds the {distinct} distinct {world['new_task']} problems",
        ),
        *_corpus_checks(world, key, distinct),
    ]
    for task in world["old_tasks"]:
        room = distinct_problems(task) - world["benchmark_size"]
        checks.append(
            (
                world["posttrain"]["examples_per_task"] <= room,
                f"{key}.posttrain.examples_per_task",
                f"exceeds the {room} {task} problems left outside its benchmark",
            )
        )
    return checks


def _corpus_checks(world: dict, key: str, distinct: int) -> list[tuple[bool, str, str]]:
    """Issue 19's corpus options, checked again when the corpus is built; a sweep should not fail an hour
    in, after pretraining. `distinct`: the new task's distinct problems."""
    corpus, checks = world["corpus"], []
    if corpus["new_task_share"] > 0:
        checks.append(
            (
                world["candidates"] + corpus["new_task_problems"] <= distinct,
                f"{key}.corpus.new_task_problems",
                f"with {key}.candidates = {world['candidates']} exceeds the {distinct} distinct "
                f"{world['new_task']} problems (the exposed problems lie outside the mining candidates)",
            )
        )
    checks += [
        (
            corpus["chat_share"] + corpus["new_task_share"] <= 1,
            f"{key}.corpus.new_task_share",
            f"with {key}.corpus.chat_share = {corpus['chat_share']} exceeds 1 (both are shares of the documents)",
        ),
        (
            not corpus["families"] or corpus["chat_share"] > 0,
            f"{key}.corpus.families",
            f"need {key}.corpus.chat_share > 0: the families are mixed into the chat documents",
        ),
    ]
    return checks


def _world_of(config: dict, exp: dict, key: str) -> tuple[dict, str]:
    """The world section experiment `exp` (at config key `key`) runs on, and that section's key."""
    name = exp["world"]
    if name == "world":
        return config["world"], "world"
    if name not in config["worlds"]:
        raise ConfigError(
            f"config key {key}.world: {name!r} is neither `world` nor a name in worlds {sorted(config['worlds'])}"
        )
    return config["worlds"][name], f"worlds.{name}"


def _world_checkpoint(world: dict, name: str) -> bool:
    """Whether `name` is a checkpoint the world keeps: `step~N` on its pretraining ladder, `post~N` on its
    post-training ladder (`graftlab.planning.layout.WORLD_LADDERS`)."""
    checkpoint = world_checkpoint(name)
    return checkpoint is not None and checkpoint.step in world[checkpoint.section]["ladder"]


def _checkpoints(world: dict) -> str:
    names = [f"{prefix}~{s}" for prefix, (section, _) in WORLD_LADDERS.items() for s in world[section]["ladder"]]
    return ", ".join(names)


def _experiment_checks(config: dict, exp: dict, key: str) -> list[tuple[bool, str, str]]:
    (world, wkey), models = _world_of(config, exp, key), set(config["models"])
    checks = []
    if exp["data"] != "knowledge" and exp["problems"] is None and not exp["stages"]:
        checks.append(
            (
                exp["mining"]["heldout"] < world["candidates"],
                f"{key}.mining.heldout",
                f"leaves no training problems of {wkey}.candidates = {world['candidates']}",
            )
        )
    # The sections of the methods whose runs are scaled SFT updates: their epochs are SFT's.
    for section in dict.fromkeys(m.section for m in METHODS.values() if m.grafts):
        g = exp[section]
        for where, epochs in ((section, g["epochs"]), (f"{section}.masks", g["masks"]["epochs"])):
            late = [e for e in epochs or [] if e > exp["sft"]["epochs"]]
            checks.append((not late, f"{key}.{where}.epochs", f"{late} exceed sft.epochs = {exp['sft']['epochs']}"))
    for donor in exp["donors"]:
        checks.append(
            (
                _world_checkpoint(world, donor) or donor in models,
                f"{key}.donors",
                f"{donor} is no checkpoint of {wkey} ({_checkpoints(world)}) nor a name in models {sorted(models)}",
            )
        )
    checks.append(
        (
            exp["post"] == "post" or exp["post"] in models,
            f"{key}.post",
            f"{exp['post']!r} is neither `post` nor a name in models {sorted(models)}",
        )
    )
    teacher = exp["teacher"]["model"]
    if exp["data"] == "teacher":
        known = teacher is not None and (teacher in ("post", *models) or _world_checkpoint(world, teacher))
        checks.append(
            (
                known,
                f"{key}.teacher.model",
                f"{teacher!r} must name the teacher of data: teacher: `post`, a checkpoint of {wkey} "
                f"({_checkpoints(world)}) or a name in models",
            )
        )
    if exp["data"] == "knowledge":
        checks.append(
            (exp["problems"] is None, f"{key}.problems", "data: knowledge writes its own questions; remove problems")
        )
        replay_ok = not (exp["knowledge"]["replay"] and exp["benchmarks"])
        checks.append(
            (
                replay_ok,
                f"{key}.knowledge.replay",
                "replays the tiny world's old tasks, but benchmarks replace them: set it to 0",
            )
        )
        checks += _knowledge_checks(exp["knowledge"], f"{key}.knowledge")
    if exp["fisher"]["prompts"] is None:
        # The retention Fisher (masks, and the sensitivity analysis every experiment runs) needs prompts
        # of the old domain; the tiny world's are only that when its tasks are the old benchmarks.
        checks.append(
            (
                not exp["benchmarks"],
                f"{key}.fisher.prompts",
                "is required: benchmarks replace the tiny world's old tasks, whose prompts the retention Fisher "
                "would otherwise use",
            )
        )
        checks += _rollout_checks(world, exp["fisher"]["rollouts"], f"{key}.fisher.rollouts")
    checks += _stage_checks(world, exp, key) if exp["stages"] else []
    checks += _sweep_checks(exp, key) + _leak_checks(exp, key)
    return checks + _method_checks(exp, key) + _pedagogical_checks(exp, key)


def _method_checks(exp: dict, key: str) -> list[tuple[bool, str, str]]:
    """Each method's section, by its spec (`graftlab.methods`): the checks its trainer makes too."""
    checks = []
    for section, spec in specs().items():
        for problem in spec.check(exp[section]):
            field, _, message = problem.partition(": ")
            checks.append((False, f"{key}.{section}.{field}", message))
    return checks


# Sweeps written as strings (result paths keep their spelling), each method's; the learning rates among them.
SWEEPS = tuple(f"{section}.{sweep}" for section, spec in specs().items() for sweep in spec.sweeps)


def _sweep_checks(exp: dict, key: str) -> list[tuple[bool, str, str]]:
    """Learning rates positive (0 trains nothing) and at most `MAX_LR` (graftlab.io.gates). Every spelled
    list's numbers finite and its values spelled once: `_spelling_checks`, for every such list of the schema."""
    checks = []
    for sweep in SWEEPS:
        if not sweep.endswith(".lr"):
            continue
        section = exp
        for part in sweep.split("."):
            section = section[part]
        zero = [v for v in section if float(v) <= 0]
        checks.append((not zero, f"{key}.{sweep}", f"{zero}: a learning rate must be positive"))
        large = [v for v in section if MAX_LR < float(v) < math.inf]  # an infinite one: `_spelling_checks`
        checks.append((not large, f"{key}.{sweep}", f"{large}: a learning rate must be at most {MAX_LR}"))
    return checks


def _source_key(source: dict) -> tuple:
    return str(source["source"]).rstrip("/"), source.get("subset"), source.get("split")


def _leak_checks(exp: dict, key: str) -> list[tuple[bool, str, str]]:
    """No training data set (`problems`, a stage's `problems`, the Fisher's `prompts`) that is also an
    evaluation set (a `benchmarks` entry or a stage's `benchmark`): scores on it would measure
    memorisation. Row-level overlap between different files is checked when the data is read
    (graftlab.tasks.sources.refuse_leaks)."""
    evaluated = {f"{key}.benchmarks.{name}": src for name, src in (exp["benchmarks"] or {}).items()}
    training = {f"{key}.problems": exp["problems"], f"{key}.fisher.prompts": exp["fisher"]["prompts"]}
    for i, stage in enumerate(exp["stages"]):
        evaluated[f"{key}.stages.{i}.benchmark"] = stage["benchmark"]
        training[f"{key}.stages.{i}.problems"] = stage["problems"]
    checks = []
    for where, src in training.items():
        if src is None:
            continue
        same = [name for name, bench in evaluated.items() if bench and _source_key(bench) == _source_key(src)]
        checks.append((not same, where, f"{src['source']!r} is also the evaluation set {same}: a leak"))
    return checks


def _stage_checks(world: dict, exp: dict, key: str) -> list[tuple[bool, str, str]]:
    """A continual experiment's stages: distinct domains, each one the tiny world can pose (or a data set
    with written solutions for SFT), none an old benchmark."""
    from graftlab.tasks.arith import SOLVERS, distinct_problems

    domains = [s["domain"] for s in exp["stages"]]
    old = list(exp["benchmarks"] or world["old_tasks"])
    checks = [(len(set(domains)) == len(domains), f"{key}.stages", f"domains {domains} repeat one")]
    for i, stage in enumerate(exp["stages"]):
        where, domain = f"{key}.stages.{i}", stage["domain"]
        kind = stage["data"] or ("knowledge" if domain == "knowledge" else "expert")
        checks.append((domain not in old, f"{where}.domain", f"{domain!r} is an old benchmark {old}"))
        many = [s for s in sections(on_policy()) if stage["steps"] and exp[s]["checkpoints"] > stage["steps"]]
        checks.append((not many, f"{where}.steps", f"{stage['steps']} is fewer than the checkpoints of {many}"))
        checks.append(
            (
                (kind == "knowledge") == (domain == "knowledge"),
                f"{where}.data",
                "knowledge data is the knowledge domain's",
            )
        )
        if kind == "knowledge":
            checks += _knowledge_checks(stage["knowledge"], f"{where}.knowledge")
            checks.append(
                (
                    not (stage["knowledge"]["replay"] and exp["benchmarks"]),
                    f"{where}.knowledge.replay",
                    "replays the tiny world's old tasks, but benchmarks replace them: set it to 0",
                )
            )
        elif stage["problems"] and kind == "expert":
            checks.append(
                (
                    "solution" in stage["problems"]["columns"],
                    f"{where}.problems.columns",
                    "needs a `solution` column: the SFT chains and the donors learn from its written solutions "
                    "(or `data: star`: the post model's own verified traces)",
                )
            )
        elif not stage["problems"]:
            known = domain in SOLVERS
            checks.append(
                (
                    known,
                    f"{where}.domain",
                    f"{domain!r} is no tiny-world task {sorted(SOLVERS)} and no data set is given",
                )
            )
            wanted = stage["train"] + stage["heldout"]
            checks.append(
                (
                    not known or wanted <= distinct_problems(domain),
                    f"{where}.train",
                    f"train + heldout = {wanted} exceed the {domain} problems there are",
                )
            )
    return checks


# What `graftlab.synth.pedagogical.teacher_prompt` fills in the Pedagogical RL teacher's template.
TEACHER_PLACEHOLDERS = ("{problem}", "{solution}")


def _pedagogical_checks(exp: dict, key: str) -> list[tuple[bool, str, str]]:
    """Pedagogical RL's teacher (a data setting, not a method): its micro-batch divides its GRPO batch, and
    its prompt template holds the problem and the reference solution."""
    ped = exp["pedagogical"]
    batch, micro = ped["prompts_per_step"] * ped["group_size"], ped["micro_batch_size"]
    ok = micro == "auto" or batch % micro == 0
    absent = holes(ped["template"], TEACHER_PLACEHOLDERS)
    return [
        (ok, f"{key}.pedagogical.micro_batch_size", f"{micro} does not divide the batch of {batch}"),
        (not absent, f"{key}.pedagogical.template", f"lacks the placeholder(s) {absent}"),
    ]


def _knowledge_checks(section: dict, where: str) -> list[tuple[bool, str, str]]:
    from graftlab.errors import GraftlabError
    from graftlab.world.knowledge import KnowledgeConfig

    try:
        KnowledgeConfig(**section)
    except GraftlabError as err:
        return [(False, where, str(err).removeprefix("knowledge: "))]
    return []


def _rollout_checks(world: dict, rollouts: int, where: str) -> list[tuple[bool, str, str]]:
    """Retention prompts are distinct old-task problems outside the benchmarks: each task must have enough."""
    from graftlab.tasks.arith import distinct_problems, per_task_counts

    tasks = world["old_tasks"]
    return [
        (
            k <= distinct_problems(task) - world["benchmark_size"],
            where,
            f"asks {k} {task} prompts; only {distinct_problems(task) - world['benchmark_size']} lie outside "
            "its benchmark",
        )
        for task, k in zip(tasks, per_task_counts(tasks, rollouts))
    ]


_NO_DEFAULT = object()


def _rows(schema: dict, defs: dict, prefix: str):
    if "$ref" in schema:  # keywords beside a $ref (a default) refine the definition
        schema = defs[schema["$ref"].rsplit("/", 1)[1]] | {k: v for k, v in schema.items() if k != "$ref"}
    if "oneOf" in schema:  # a nullable section: one row for the section, then the object's own keys
        yield prefix, "object or null", schema.get("default", _NO_DEFAULT), schema.get("description", "")
        for sub in schema["oneOf"]:
            if sub.get("type") != "null":
                yield from _rows(sub, defs, prefix)
        return
    props = schema.get("properties")
    extra = schema.get("additionalProperties")
    if props is None and isinstance(extra, dict):  # a map of named entries (experiments)
        yield prefix, "map", schema.get("default", _NO_DEFAULT), schema.get("description", "")
        yield from _rows(extra, defs, f"{prefix}.<name>")
        return
    if props is None:
        item = schema.get("items", {})
        if "$ref" in item:
            item = defs[item["$ref"].rsplit("/", 1)[1]]
        types = schema.get("type", "any")
        kinds = [
            f"list of {item.get('type', 'any')}" if t == "array" else t
            for t in (types if isinstance(types, list) else [types])
        ]
        kind = " or ".join(kinds)
        yield prefix, kind, schema.get("default", _NO_DEFAULT), schema.get("description", item.get("description", ""))
        if "properties" in item:  # a list of sections (stages): the keys of each entry
            yield from _rows(item, defs, f"{prefix}[]")
        return
    for key, sub in props.items():
        yield from _rows(sub, defs, f"{prefix}.{key}" if prefix else key)


def render_reference(schema: dict) -> str:
    """The config reference as a Markdown table, one row per leaf key."""
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, kind, default, text in _rows(schema, schema.get("$defs", {}), ""):
        shown = "" if default is _NO_DEFAULT else f"`{json.dumps(default)}`"
        # A `|` in a description (KL(T||S)) would end the table cell: escape it.
        meaning = " ".join(text.split()).replace("|", r"\|")
        lines.append(f"| `{key}` | {kind} | {shown} | {meaning} |")
    return "\n".join(lines) + "\n"


REFERENCE_PAGE = "docs/config.md"
REGENERATE = f"python -m graftlab.planning.config > {REFERENCE_PAGE}"
_HEADER = f"""# Configuration reference

Every key of `config.yaml`: its type, its default and what it means. Unknown keys are errors. A key
is a dotted path; `<name>` stands for a name of your choosing (an experiment, a world, a model, a
benchmark). Layering a file over the default, sweeps, worlds and seeds: [sweeps.md](sweeps.md).

This page is generated from `src/graftlab/config.schema.yaml`, and a test fails when the two disagree: edit
the schema, then run `{REGENERATE}`.

"""


def render_page(schema: dict) -> str:
    """The whole of docs/config.md: what it is and how to regenerate it, then the reference table."""
    return _HEADER + render_reference(schema)


if __name__ == "__main__":
    print(render_page(load_schema()), end="")
