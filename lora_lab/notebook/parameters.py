"""A notebook's parameters: reading the `parameters` cell and papermill's injected cell, and checking them.

The defaults are the last cell of UPPER_CASE literal assignments; a value injected for a name must be
defined there, of the default's type (also inside lists and dicts), finite unless the parameter's
comment says it takes NaN/Inf, and within the range its comment declares (ranges.py). Values are read with
`ast` (literals only): nothing injected runs code.
"""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path
from typing import Any

from ..errors import LoraLabError
from .ranges import RangeSyntaxError, parse_range, range_error


class NotebookParameterError(LoraLabError):
    """An injected parameter that the notebook does not define, of the wrong type, or NaN/Inf where not
    allowed."""


_NONFINITE_NAMES = {"nan", "inf", "infinity"}


def literal_value(node: ast.AST) -> Any:
    """A literal, or float('nan') / float('inf') (as papermill writes them), also inside containers and
    signed."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "float" \
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Constant) \
            and str(node.args[0].value).strip().lower().lstrip("+-") in _NONFINITE_NAMES:
        return float(node.args[0].value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = literal_value(node.operand)
        if isinstance(v, bool) or not isinstance(v, (int, float, complex)):
            raise TypeError("a sign before a non-number")
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [literal_value(e) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {literal_value(k): literal_value(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)  # constants (and binary complex numbers); anything else: ValueError


def _assignments(source: str) -> dict[str, tuple[Any, str]] | None:
    """{name: (value, comment)} if `source` is only `name = value  # comment` lines, else None."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, RecursionError, MemoryError):
        return None
    if not tree.body:
        return None
    lines = source.splitlines()
    out = {}
    for stmt in tree.body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)):
            return None
        try:
            value = literal_value(stmt.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        # offsets: bytes
        rest = lines[stmt.end_lineno - 1].encode()[stmt.end_col_offset:].decode(errors="replace")
        out[stmt.targets[0].id] = (value, rest.partition("#")[2].strip())
    return out


def literal_assignments(source: str) -> dict[str, Any] | None:
    """{NAME: value} if `source` is only `UPPER_CASE = literal` lines (and comments), else None."""
    found = _assignments(source)
    if found is None or not all(name.isupper() for name in found):
        return None
    return {name: value for name, (value, _) in found.items()}


def _injected_assignments(source: str) -> dict[str, Any]:
    """papermill's injected cell as {name: value}, names in any case; NotebookParameterError if unreadable."""
    found = _assignments(source)
    if found is None:
        bad = next((ln for ln in source.splitlines()[1:] if ln.strip() and _assignments(ln) is None), source)
        name = bad.partition("=")[0].strip() or "?"
        raise NotebookParameterError(f"injected parameter {name}: cannot read {bad.strip()!r} "
                                     "(each must be NAME = a literal value)")
    return {name: value for name, (value, _) in found.items()}


def _kind_error(default: Any, value: Any) -> str | None:
    """Why `value` cannot replace `default` (None if it can): the same type, also inside lists and dicts."""
    if isinstance(default, bool) or isinstance(value, bool):
        ok = type(default) is type(value)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float))  # papermill injects 1 for 1.0
    elif isinstance(default, (list, tuple)):
        ok = isinstance(value, (list, tuple))  # papermill turns tuples into lists
        kinds = {type(d) for d in default}
        # a homogeneous list: so are its items
        if ok and default and (len(kinds) == 1 or kinds == {int, float}):
            model = float(default[0]) if float in kinds else default[0]
            for i, item in enumerate(value):
                why = _kind_error(model, item)
                if why:
                    return f"item {i}: {why}"
    elif isinstance(default, dict):
        ok = isinstance(value, dict)
        for key, item in value.items() if ok else ():
            if key not in default:
                return f"key {key!r} is not one of {sorted(map(str, default))}"
            why = _kind_error(default[key], item)
            if why:
                return f"key {key!r}: {why}"
    elif default is None:
        ok = True  # None: the notebook says in the comment what else it takes
    else:
        ok = type(default) is type(value)
    if ok:
        return None
    return f"{value!r} is a {type(value).__name__}, but the default {default!r} is a {type(default).__name__}"


def _nonfinite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple, set)):
        return any(map(_nonfinite, value))
    if isinstance(value, dict):
        return any(map(_nonfinite, value.values()))
    return False


def _takes_nonfinite(comment: str) -> bool:
    """A parameter takes NaN/Inf only where its comment names them (e.g. `# float; inf = no limit`)."""
    return re.search(r"\b(nan|inf|infinity)\b", comment, re.IGNORECASE) is not None


def check_parameters(defaults: dict[str, Any], injected: dict[str, Any],
                     nonfinite_ok: frozenset[str] = frozenset()) -> None:
    """Raise NotebookParameterError naming the parameter for an unknown name (any case), a value of
    another type than its default, or NaN/Inf in a parameter not listed in `nonfinite_ok`."""
    unknown = sorted(set(injected) - set(defaults))
    if unknown:
        near = {u: [d for d in defaults if d.lower() == u.lower()] for u in unknown}
        hint = "".join(f" ({u!r}: did you mean {n[0]!r}?)" for u, n in near.items() if n)
        raise NotebookParameterError(
            f"unknown parameter(s) {unknown}{hint}; this notebook takes {sorted(defaults)}"
        )
    for name, value in injected.items():
        why = _kind_error(defaults[name], value)
        if why:
            raise NotebookParameterError(f"parameter {name}: {why}")
        if name not in nonfinite_ok and _nonfinite(value):
            raise NotebookParameterError(f"parameter {name}={value!r}: NaN and Inf are not allowed here "
                                         "(its comment in the parameters cell says what is)")


def check_ranges(comments: dict[str, str], values: dict[str, Any]) -> None:
    """Raise NotebookParameterError naming the parameter for a value outside the range its comment declares
    (a bound may name another parameter: it is read from `values`)."""
    for name, value in values.items():
        comment = comments.get(name, "")
        try:
            spec = parse_range(comment)
            why = spec and range_error(spec, value, values)
        except RangeSyntaxError as e:  # a bound that names no numeric parameter
            raise NotebookParameterError(f"parameter {name}: its comment {comment!r:.80} declares a range "
                                         f"that cannot be checked ({e})") from None
        if why:
            declared = re.split(r"[:;]", comment, maxsplit=1)[0].strip()
            raise NotebookParameterError(f"parameter {name}={value!r:.80}: {why}; the parameters cell says "
                                         f"{declared}")


def as_declared(default: Any, value: Any) -> Any:
    """`value` with an int where the default holds a float made a float (papermill writes 1 for 1.0), also
    inside lists and dicts; NotebookParameterError for an int too large for a float."""
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            digits = len(str(abs(value)))
            raise NotebookParameterError(f"an int of {digits} digits is too large for a float") from None
    if isinstance(default, (list, tuple)) and isinstance(value, list) and default:
        kinds = {type(d) for d in default}
        if float in kinds and kinds <= {int, float}:
            return [as_declared(1.0, v) for v in value]
    if isinstance(default, dict) and isinstance(value, dict):
        return {k: as_declared(default[k], v) if k in default else v for k, v in value.items()}
    return value


def parameters_from_history(inputs: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(defaults, injected) from the executed cells: the last literal-only cell is the
    defaults; papermill's injected cell (it begins with '# Parameters') follows it."""
    defaults, injected, _ = parameter_cells(inputs)
    return defaults, injected


def parameter_cells(inputs: list[str]) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """(defaults, injected, each parameter's comment) from the executed cells."""
    defaults: dict[str, Any] = {}
    injected: dict[str, Any] = {}
    comments: dict[str, str] = {}
    for src in inputs:
        if src.lstrip().startswith("# Parameters"):
            injected = _injected_assignments(src)
            continue
        found = _assignments(src)
        if found is None or not all(name.isupper() for name in found):
            continue
        defaults = {name: value for name, (value, _) in found.items()}
        comments = {name: comment for name, (_, comment) in found.items()}
        injected = {}
    return defaults, injected, comments


def nonfinite_allowed(comments: dict[str, str]) -> frozenset[str]:
    """The parameters whose comment says they take NaN/Inf."""
    return frozenset(name for name, comment in comments.items() if _takes_nonfinite(comment))


def notebook_parameters(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(defaults, each parameter's comment) of the .ipynb at `path`: its cell tagged `parameters`."""
    try:
        cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise NotebookParameterError(f"{path}: cannot read the notebook ({e})") from None
    for cell in cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            defaults, _, comments = parameter_cells([source])
            return defaults, comments
    return {}, {}


def expected_parameters(path: Path, injected: dict[str, Any]) -> dict[str, Any]:
    """The parameters the notebook at `path` runs with when given `injected` (its defaults, then those), each
    checked as `Record.start` checks it: NotebookParameterError naming the notebook and the parameter, before
    any kernel starts."""
    defaults, comments = notebook_parameters(path)
    try:
        check_parameters(defaults, injected, nonfinite_allowed(comments))
        values = {**defaults, **{k: as_declared(defaults[k], v) for k, v in injected.items()}}
        check_ranges(comments, values)
    except NotebookParameterError as e:
        raise NotebookParameterError(f"{Path(path).stem}: {e}") from None
    return values
