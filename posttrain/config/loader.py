"""Load a typed config from YAML plus dotted overrides, and fail loudly with the fix in the message.

Every error names where the bad value came from (``file:line`` or the command-line override),
the dotted key, and what to do: an unknown key names the nearest valid key, a wrong type names
the expected type. Nothing is silently dropped: models forbid extra keys.

Every user YAML posttrain reads (recipes, overrides, eval suites, a run's ``config.yaml``, rules files) goes
through ``load_yaml`` / ``read_yaml``, which refuse a file before building any Python object from it when
it is over ``MAX_YAML_BYTES``, expands through its aliases to more than ``MAX_YAML_NODES`` values (a 1 KB
"billion laughs" file names 10**9) or nests deeper than ``MAX_YAML_DEPTH`` (PyYAML's composer recurses
once per level). A config is a few hundred values, so the bounds only ever stop hostile or broken files.
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from posttrain.recipes import find_recipe


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    def changed_fields(self) -> set[str]:
        """The keys given a value other than their default. A key that applies only in another mode (a reward
        model's ``batch_size`` on a verifier term) is refused when *changed*, not when merely present: the resolved
        config a run saves (``dump_config``, every default written out) must load again as it was."""
        fields = type(self).model_fields
        return {key for key in self.model_fields_set
                if key in fields and (fields[key].is_required()
                                      or getattr(self, key) != fields[key].get_default(call_default_factory=True))}


class ConfigError(ValueError):
    """One or more problems with a config; ``str()`` lists them one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


_YAML11_WORDS = {"on", "off", "yes", "no", "y", "n"}

MAX_YAML_BYTES = 10 * 2**20
MAX_YAML_NODES = 100_000  # values after expanding every alias; an eval suite this big belongs in a .jsonl file
MAX_YAML_DEPTH = 200  # levels below the top: `a: [[1]]` nests 3 deep


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose composer stops at ``MAX_YAML_DEPTH`` levels, before Python's recursion limit does
    (each level costs a few frames, so a 20,000-deep file would end in RecursionError)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1  # the nodes on the path, this one included: its depth (the root's is 0) plus one
        try:
            if self._depth > MAX_YAML_DEPTH + 1:
                raise _TooBig(self.peek_event().start_mark, f"YAML nested more than {MAX_YAML_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _TooBig(Exception):
    def __init__(self, mark: yaml.Mark | None, problem: str):
        super().__init__(problem)
        self.mark, self.problem = mark, problem


def _expanded_size(node: yaml.Node, depth: int, sizes: dict[int, tuple[int, int]], open_: set[int]) -> int:
    """The number of values ``node`` stands for once every alias is expanded; ``_TooBig`` past the bounds.

    An alias is the very node it names (PyYAML's composer shares it), so a node reached twice is counted
    twice, from ``sizes`` (id → (size, height)): the walk visits each node once however often it is named.
    Recursion is bounded by ``MAX_YAML_DEPTH``; ``open_`` holds the nodes on the current path (a cycle).
    """
    if id(node) in sizes:
        size, height = sizes[id(node)]
        if depth + height > MAX_YAML_DEPTH:
            raise _TooBig(node.start_mark, f"YAML nested more than {MAX_YAML_DEPTH} levels deep (through aliases)")
        return size
    if depth > MAX_YAML_DEPTH:
        raise _TooBig(node.start_mark, f"YAML nested more than {MAX_YAML_DEPTH} levels deep")
    if id(node) in open_:
        raise _TooBig(node.start_mark, "an alias refers to a value that contains it (a recursive structure)")
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    else:
        children = []
    open_.add(id(node))
    size, height = 1, 0
    for child in children:
        size += _expanded_size(child, depth + 1, sizes, open_)
        height = max(height, 1 + sizes[id(child)][1])
        if size > MAX_YAML_NODES:
            raise _TooBig(node.start_mark, f"YAML of more than {MAX_YAML_NODES} values once its aliases (`*name`) "
                          "are expanded; a config is a few hundred")
    open_.discard(id(node))
    sizes[id(node)] = (size, height)
    return size


def _load_bounded(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """The value of YAML ``text`` and its node graph, composed once and checked against the bounds before
    any Python object is built from it. ``yaml.YAMLError`` for invalid YAML; ConfigError past a bound."""
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > MAX_YAML_BYTES:
        raise ConfigError([f"{source}: {size} bytes, more than the {MAX_YAML_BYTES} bytes a YAML file may have"])
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        _expanded_size(node, 0, {}, set())
        return loader.construct_document(node), node
    except _TooBig as exc:
        where = f"{source}:{exc.mark.line + 1}" if exc.mark else source
        raise ConfigError([f"{where}: {exc.problem}"]) from None
    except RecursionError:  # a backstop: the bounds above stop every nesting the composer would recurse into
        raise ConfigError([f"{source}: YAML nested more than {MAX_YAML_DEPTH} levels deep"]) from None
    finally:
        loader.dispose()


def _parse_checked(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    try:
        return _load_bounded(text, source)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError([f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}"]) from None


def load_yaml(text: str, source: str) -> Any:
    """The value of YAML ``text`` (``source`` names it in errors): the one way posttrain parses a user's YAML.
    ConfigError for invalid YAML or YAML past the bounds (``MAX_YAML_*``), naming ``source`` and the line."""
    return _parse_checked(text, source)[0]

Override = tuple[tuple[str, ...], Any, str]  # (dotted path, parsed value, original text)


def parse_overrides(items: list[str]) -> list[Override]:
    """Parse ``a.b.c=value`` items; the value is read as YAML (``3e-4`` → float, ``[a, b]`` → list)."""
    parsed: list[Override] = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"command line: `{item}`: expected key=value, e.g. train.lr=3e-4"])
        try:
            value = _load_bounded(raw, f"command line `{item}`")[0] if raw.strip() else ""
        except yaml.YAMLError:
            value = raw  # not YAML: the text itself (a bound exceeded is still a ConfigError)
        # YAML 1.1 reads on/off/yes/no as booleans; on the command line they are words.
        if raw.strip().lower() in _YAML11_WORDS:
            value = raw.strip()
        # YAML 1.1 reads 3e-4 as a string; users mean a number.
        if isinstance(value, str):
            try:
                value = float(value) if any(c in value for c in ".eE") else value
            except ValueError:
                pass
        parsed.append((tuple(key.strip().split(".")), value, item))
    return parsed


def _line_map(node: yaml.Node, prefix: tuple[str, ...], out: dict[tuple[str, ...], int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (str(key_node.value),)
            out[path] = key_node.start_mark.line + 1
            _line_map(value_node, path, out)
    elif isinstance(node, yaml.SequenceNode):
        for index, child in enumerate(node.value):
            path = prefix + (str(index),)
            out[path] = child.start_mark.line + 1
            _line_map(child, path, out)


def read_yaml(path: str | Path) -> tuple[dict[str, Any], dict[tuple[str, ...], int]]:
    """Read a YAML mapping and the line of every key in it (bounded as ``load_yaml``)."""
    with open(path, "rb") as handle:
        raw = handle.read(MAX_YAML_BYTES + 1)  # no more than the bound, however big the file is
    if len(raw) > MAX_YAML_BYTES:
        size = Path(path).stat().st_size
        raise ConfigError([f"{path}: {size} bytes, more than the {MAX_YAML_BYTES} bytes a YAML file may have"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError([f"{path}:{line}: not valid YAML: invalid UTF-8 at byte {exc.start}"]) from None
    data, node = _parse_checked(text, str(path))
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of keys to values"])
    lines: dict[tuple[str, ...], int] = {}
    if node is not None:
        _line_map(node, (), lines)
    return data, lines


def _set_dotted(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    cursor = data
    for part in path[:-1]:
        nxt = cursor.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            cursor[part] = nxt
        cursor = nxt
    cursor[path[-1]] = value


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class inside an annotation such as ``Foo``, ``Foo | None`` or ``list[Foo]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list, tuple, dict, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def _model_at(schema: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = schema
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int) or part not in model.model_fields:
            continue  # list index or a union tag: stay on the same model
        model = _model_in(model.model_fields[part].annotation)
    return model


def _where(path: tuple[str, ...], source: str | None, lines: dict, overrides: dict,
           overrides_from: str = "command line") -> str:
    for cut in range(len(path), 0, -1):
        if path[:cut] in overrides:
            return f"{overrides_from} `{overrides[path[:cut]]}`"
        if path[:cut] in lines and source:
            return f"{source}:{lines[path[:cut]]}"
    return source or "config"


def nearest_keys(key: str, valid: list[str]) -> list[str]:
    """Closest valid key: an abbreviation by initials (``learning_rate`` → ``lr``) or by spelling."""
    initials = "".join(part[0] for part in key.split("_") if part)
    if len(initials) > 1 and initials in valid:
        return [initials]
    return difflib.get_close_matches(key, valid, n=1, cutoff=0.5)


def _describe(error: dict, schema: type[BaseModel], where: str) -> str:
    loc = tuple(str(p) for p in error["loc"] if not str(p).startswith("function-"))
    dotted = ".".join(loc) or "(top level)"
    kind = error["type"]
    if kind == "extra_forbidden":
        parent = _model_at(schema, tuple(error["loc"][:-1]))
        valid = sorted(parent.model_fields) if parent else []
        guess = nearest_keys(loc[-1], valid)
        prefix = ".".join(loc[:-1])
        if guess:
            hint = f"did you mean `{prefix + '.' if prefix else ''}{guess[0]}`?"
        else:
            hint = f"valid keys here: {', '.join(valid)}"
        return f"{where}: `{dotted}`: unknown key; {hint}"
    if kind == "missing":
        return f"{where}: `{dotted}`: required key is missing"
    message = error["msg"]
    if kind.startswith("value_error"):
        message = message.removeprefix("Value error, ")
        return f"{where}: `{dotted}`: {message}"
    got = error.get("input")
    shown = repr(got) if not isinstance(got, dict) else "a mapping"
    return f"{where}: `{dotted}`: {message} (got {shown})"


def load_config(
    schema: type[BaseModel],
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    data: dict[str, Any] | None = None,
    overrides_from: str = "command line",
) -> BaseModel:
    """Build ``schema`` from a YAML file (or ``data``) plus dotted overrides; raise ConfigError.

    ``overrides_from`` names where the overrides came from in errors (a flywheel stage's ``sft.overrides``)."""
    lines: dict[tuple[str, ...], int] = {}
    if path is not None:
        path = find_recipe(path)  # a file, or the name of a packaged recipe (`sft_tiny`)
        data, lines = read_yaml(path)
    source = str(path) if path is not None else None
    data = dict(data or {})
    parsed = parse_overrides(overrides or [])
    override_text: dict[tuple[str, ...], str] = {}
    for key, value, text in parsed:
        _set_dotted(data, key, value)
        override_text[key] = text
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            loc = tuple(str(p) for p in error["loc"])
            problems.append(_describe(error, schema, _where(loc, source, lines, override_text, overrides_from)))
        raise ConfigError(problems) from None


def resolve_recipe(path: str | Path, overrides: list[str] | None = None) -> tuple[str, BaseModel]:
    """Read the ``recipe:`` key of a YAML file (or packaged recipe) and validate it against that recipe's schema."""
    from posttrain.config.registry import RECIPES, load_builtin_recipes

    load_builtin_recipes()
    path = find_recipe(path)
    data, lines = read_yaml(path)
    name = data.get("recipe")
    for key, value, _ in parse_overrides(overrides or []):
        if key == ("recipe",):
            name = value
    if name not in RECIPES:
        line = lines.get(("recipe",))
        where = f"{path}:{line}" if line else str(path)
        guess = difflib.get_close_matches(str(name), list(RECIPES), n=1)
        hint = f"did you mean `{guess[0]}`?" if guess else f"one of: {', '.join(sorted(RECIPES))}"
        raise ConfigError([f"{where}: `recipe`: unknown or missing recipe {name!r}; {hint}"])
    return name, load_config(RECIPES[name].schema, path, overrides)


def dump_config(config: BaseModel, path: str | Path) -> None:
    """Write the fully resolved config (defaults included) as YAML."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
