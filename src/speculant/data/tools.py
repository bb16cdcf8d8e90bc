"""``builtin:tools``: chat requests that need a tool call, with tools made from real standard-library functions.

Each tool is a standard-library function (``math.gcd``, ``os.path.join``, ``calendar.monthrange`` ...) in OpenAI's
``tools`` format: ``{"type": "function", "function": {"name", "description", "parameters"}}``. The name is the
dotted name with ``_`` for ``.`` (``math_gcd``), the description the first paragraph of the function's own
docstring (the running interpreter's), the parameters a JSON Schema whose property names are the function's own
parameter names (:func:`inspect.signature` where the function has one; a ``*args`` parameter is an array) and whose
types are stated here per function (the standard library has no annotations); parameters with no JSON form
(``key=``, ``cls=``, ``**kwargs``) are left out. :func:`tool_catalogue` lists them.

Each request ``{"id", "category", "messages", "tools", "tool_choice", "parallel_tool_calls", "expected"}``: a
system message and a user message that needs exactly one of the tools (its values drawn from a seeded generator),
the right tool among ``distractors`` others (one from the same module when there is one, the rest seeded picks;
the order shuffled), ``tool_choice`` alternating ``auto`` and ``required`` (the ``category``),
``parallel_tool_calls`` false (one call answers it), and ``expected``: ``{"name", "arguments"}``, the call that
answers it (arguments with their defaults left out). The same ``seed`` gives the same
set on one interpreter.

:func:`tool_call_errors` checks a call against the request's tools (validity: the named tool exists and its
arguments parse and match its parameters' schema); :func:`call_matches` checks it against ``expected``.
"""

from __future__ import annotations

import calendar
import importlib
import inspect
import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .json_schema import check_schema, json_equal, parse_json, schema_errors

__all__ = ["CATEGORIES", "SYSTEM", "Tool", "call_matches", "tool_call_errors", "tool_calls_report",
           "tool_catalogue", "tools_prompts"]

CATEGORIES = ("auto", "required")
"""The ``tool_choice`` of the requests, alternating (each record's ``category``)."""

SYSTEM = ("You are an assistant that answers by calling tools. Call the one tool that answers the user's request, "
          "with the arguments the request gives.")
"""The system message of every request."""

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_MONTHS = list(calendar.month_name)[1:]
_WORDS = ("apple", "apply", "ample", "maple", "angle", "table", "cable", "staple", "sample", "simple", "temple")
_HOSTS = ("example.org", "docs.python.org", "localhost:8080", "files.example.com")
_TEXTS = ("The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill.",
          "Speculative decoding drafts several tokens cheaply and lets the large model verify them in one pass.",
          "A journey of a thousand miles begins with a single step, and then many more after that one.")


def _pick(rng: random.Random, seq: Sequence) -> Any:
    return seq[rng.randrange(len(seq))]


def _ints(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _listed(items: Sequence) -> str:
    words = [str(x) for x in items]
    return ", ".join(words[:-1]) + " and " + words[-1]


def _path(rng: random.Random) -> str:
    return "/" + "/".join(rng.sample(["home", "data", "srv", "projects", "logs", "tmp", "reports", "2024"], 3))


def _ask_gcd(rng):
    a, b = rng.randint(2, 30) * 6, rng.randint(2, 30) * 4
    return f"What is the greatest common divisor of {a} and {b}?", {"integers": [a, b]}


def _ask_lcm(rng):
    xs = _ints(rng, 3, 2, 24)
    return f"What is the least common multiple of {_listed(xs)}?", {"integers": xs}


def _ask_comb(rng):
    n = rng.randint(6, 40)
    k = rng.randint(2, 5)
    return f"In how many ways can I pick {k} people out of {n}, order not mattering?", {"n": n, "k": k}


def _ask_perm(rng):
    n = rng.randint(5, 20)
    k = rng.randint(2, 4)
    return f"How many ordered arrangements of {k} items can be made from {n} distinct items?", {"n": n, "k": k}


def _ask_factorial(rng):
    n = rng.randint(5, 20)
    return f"What is {n} factorial?", {"n": n}


def _ask_isqrt(rng):
    n = rng.randint(1000, 999999)
    return f"What is the integer square root of {n}?", {"n": n}


def _ask_dist(rng):
    p, q = _ints(rng, 2, -9, 9), _ints(rng, 2, -9, 9)
    return (f"How far apart are the points ({p[0]}, {p[1]}) and ({q[0]}, {q[1]}) in a straight line?",
            {"p": p, "q": q})


def _ask_degrees(rng):
    x = _pick(rng, (0.5, 1.25, 2.0, 3.5))
    return f"Convert an angle of {x} radians to degrees.", {"x": x}


def _ask_radians(rng):
    x = _pick(rng, (30, 45, 90, 135, 270))
    return f"Convert {x} degrees to radians.", {"x": x}


def _ask_join(rng):
    parts = rng.sample(["usr", "local", "share", "docs", "config", "cache", "index.html"], 3)
    return f"Join the path components {_listed(repr(p) for p in parts)} into one path.", {"a": parts[0],
                                                                                           "p": parts[1:]}


def _ask_splitext(rng):
    name = f"{_path(rng)}/{_pick(rng, ('report', 'archive', 'photo', 'notes'))}.{_pick(rng, ('txt', 'tar', 'png'))}"
    return f"Split the file name {name} into its root and its extension.", {"p": name}


def _ask_basename(rng):
    name = f"{_path(rng)}/{_pick(rng, ('main.py', 'README.md', 'data.csv'))}"
    return f"What is the final component of the path {name}?", {"p": name}


def _ask_commonprefix(rng):
    base = _path(rng)
    paths = [f"{base}/{x}" for x in rng.sample(["a.txt", "b.txt", "sub/c.txt", "d.log"], 3)]
    return f"What is the longest common leading part of these paths: {_listed(paths)}?", {"m": paths}


def _ask_disk_usage(rng):
    path = _pick(rng, ("/", "/home", "/tmp", "/var/log"))
    return f"How much disk space is used and free on {path}?", {"path": path}


def _ask_dumps(rng):
    obj = {"name": _pick(rng, _WORDS), "count": rng.randint(1, 99), "tags": rng.sample(list(_WORDS), 2)}
    indent = _pick(rng, (2, 4))
    return (f"Serialize {json.dumps(obj)} to a JSON string indented by {indent} spaces, with its keys sorted.",
            {"obj": obj, "indent": indent, "sort_keys": True})


def _ask_isleap(rng):
    year = rng.randint(1890, 2100)
    return f"Is {year} a leap year?", {"year": year}


def _ask_monthrange(rng):
    year, month = rng.randint(1990, 2030), rng.randint(1, 12)
    return (f"For {_MONTHS[month - 1]} {year} (month {month}), which weekday does it start on and how many days "
            "does it have?", {"year": year, "month": month})


def _ask_weekday(rng):
    year, month, day = rng.randint(1950, 2030), rng.randint(1, 12), rng.randint(1, 28)
    return (f"Which day of the week was {_MONTHS[month - 1]} {day}, {year} (month {month})?",
            {"year": year, "month": month, "day": day})


def _ask_leapdays(rng):
    y1 = rng.randint(1800, 1990)
    y2 = y1 + rng.randint(10, 200)
    return f"How many leap years are there from {y1} up to, but not including, {y2}?", {"y1": y1, "y2": y2}


def _ask_shorten(rng):
    text, width = _pick(rng, _TEXTS), _pick(rng, (30, 40, 50))
    return f"Collapse and truncate this text to fit in {width} characters: {text}", {"text": text, "width": width}


def _ask_wrap(rng):
    text, width = _pick(rng, _TEXTS), _pick(rng, (20, 25, 30))
    return f"Wrap this paragraph into lines of at most {width} characters: {text}", {"text": text, "width": width}


def _ask_mean(rng):
    xs = _ints(rng, 5, 1, 60)
    return f"What is the arithmetic mean of {_listed(xs)}?", {"data": xs}


def _ask_median(rng):
    xs = _ints(rng, 7, 1, 99)
    return f"What is the median of these values: {_listed(xs)}?", {"data": xs}


def _ask_stdev(rng):
    xs = _ints(rng, 6, 10, 40)
    return f"What is the sample standard deviation of {_listed(xs)}?", {"data": xs}


def _ask_urlsplit(rng):
    url = f"https://{_pick(rng, _HOSTS)}{_path(rng)}?page={rng.randint(1, 9)}#top"
    return f"Split the URL {url} into its components.", {"url": url}


def _ask_close_matches(rng):
    word = _pick(rng, _WORDS[:4])
    pool = rng.sample(list(_WORDS), 6)
    return (f"Which of the words {_listed(pool)} are the closest matches to {word!r}?",
            {"word": word, "possibilities": pool})


def _ask_ip_address(rng):
    address = _pick(rng, (f"192.168.{rng.randint(0, 255)}.{rng.randint(1, 254)}", "2001:db8::1", "10.0.0.1"))
    return f"Parse {address} as an IP address and tell me whether it is IPv4 or IPv6.", {"address": address}


def _ask_nlargest(rng):
    xs, n = _ints(rng, 8, 1, 500), rng.randint(2, 4)
    return f"Which are the {n} largest numbers among {_listed(xs)}?", {"n": n, "iterable": xs}


def _ask_fromisoformat(rng):
    day = f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    return f"Construct a date from the ISO 8601 string {day}.", {"date_string": day}


def _array(items: dict) -> dict:
    return {"type": "array", "items": items}


# (dotted name, parameters: name -> schema, in signature order, the required ones first; request maker)
_CATALOGUE: tuple[tuple[str, dict[str, dict], tuple[str, ...], Callable], ...] = (
    ("math.gcd", {"integers": _array(_INT)}, ("integers",), _ask_gcd),
    ("math.lcm", {"integers": _array(_INT)}, ("integers",), _ask_lcm),
    ("math.comb", {"n": _INT, "k": _INT}, ("n", "k"), _ask_comb),
    ("math.perm", {"n": _INT, "k": _INT}, ("n",), _ask_perm),
    ("math.factorial", {"n": _INT}, ("n",), _ask_factorial),
    ("math.isqrt", {"n": _INT}, ("n",), _ask_isqrt),
    ("math.dist", {"p": _array(_NUM), "q": _array(_NUM)}, ("p", "q"), _ask_dist),
    ("math.degrees", {"x": _NUM}, ("x",), _ask_degrees),
    ("math.radians", {"x": _NUM}, ("x",), _ask_radians),
    ("os.path.join", {"a": _STR, "p": _array(_STR)}, ("a",), _ask_join),
    ("os.path.splitext", {"p": _STR}, ("p",), _ask_splitext),
    ("os.path.basename", {"p": _STR}, ("p",), _ask_basename),
    ("os.path.commonprefix", {"m": _array(_STR)}, ("m",), _ask_commonprefix),
    ("shutil.disk_usage", {"path": _STR}, ("path",), _ask_disk_usage),
    ("json.dumps", {"obj": {"type": "object"}, "skipkeys": _BOOL, "ensure_ascii": _BOOL, "indent": _INT,
                    "sort_keys": _BOOL}, ("obj",), _ask_dumps),
    ("calendar.isleap", {"year": _INT}, ("year",), _ask_isleap),
    ("calendar.monthrange", {"year": _INT, "month": {"type": "integer", "minimum": 1, "maximum": 12}},
     ("year", "month"), _ask_monthrange),
    ("calendar.weekday", {"year": _INT, "month": {"type": "integer", "minimum": 1, "maximum": 12},
                          "day": {"type": "integer", "minimum": 1, "maximum": 31}}, ("year", "month", "day"),
     _ask_weekday),
    ("calendar.leapdays", {"y1": _INT, "y2": _INT}, ("y1", "y2"), _ask_leapdays),
    ("textwrap.shorten", {"text": _STR, "width": _INT}, ("text", "width"), _ask_shorten),
    ("textwrap.wrap", {"text": _STR, "width": _INT}, ("text",), _ask_wrap),
    ("statistics.mean", {"data": _array(_NUM)}, ("data",), _ask_mean),
    ("statistics.median", {"data": _array(_NUM)}, ("data",), _ask_median),
    ("statistics.stdev", {"data": _array(_NUM), "xbar": _NUM}, ("data",), _ask_stdev),
    ("urllib.parse.urlsplit", {"url": _STR, "scheme": _STR, "allow_fragments": _BOOL}, ("url",), _ask_urlsplit),
    ("difflib.get_close_matches", {"word": _STR, "possibilities": _array(_STR), "n": _INT,
                                   "cutoff": {"type": "number", "minimum": 0, "maximum": 1}},
     ("word", "possibilities"), _ask_close_matches),
    ("ipaddress.ip_address", {"address": _STR}, ("address",), _ask_ip_address),
    ("heapq.nlargest", {"n": _INT, "iterable": _array(_NUM)}, ("n", "iterable"), _ask_nlargest),
    ("datetime.date.fromisoformat", {"date_string": _STR}, ("date_string",), _ask_fromisoformat),
)


@dataclass(frozen=True)
class Tool:
    """One tool: the standard-library function ``dotted`` in OpenAI's format (:attr:`spec`), and ``ask(rng) ->
    (user message, expected arguments)``."""

    dotted: str
    spec: dict
    ask: Callable[[random.Random], tuple[str, dict]]

    @property
    def name(self) -> str:
        return self.spec["function"]["name"]

    @property
    def module(self) -> str:
        return self.dotted.rsplit(".", 1)[0]

    def call(self, arguments: Mapping[str, Any]) -> Any:
        """Run the function with a call's ``arguments`` (checked by :func:`tool_call_errors` first): by position up
        to the first parameter left out (every parameter of a builtin without a signature), a ``*args`` parameter's
        array spread, the rest by keyword."""
        func = _resolve(self.dotted)
        try:
            params = inspect.signature(func).parameters
        except (TypeError, ValueError):
            return func(*(arguments[name] for name in self.spec["function"]["parameters"]["properties"]
                          if name in arguments))
        args: list = []
        kwargs: dict[str, Any] = {}
        by_position = True  # until a parameter is left out: the rest go by keyword
        for name, p in params.items():
            if name not in arguments:
                by_position = by_position and p.kind is p.VAR_POSITIONAL
            elif p.kind is p.VAR_POSITIONAL:
                args.extend(arguments[name])
            elif by_position and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                args.append(arguments[name])
            else:
                kwargs[name] = arguments[name]
        return func(*args, **kwargs)


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _description(func: Any, dotted: str) -> str:
    """The first paragraph of ``func``'s docstring on one line, skipping a leading signature line (``name(...)`` or
    ``... -> ...``, as builtins' docstrings start)."""
    doc = inspect.getdoc(func) or ""
    for paragraph in doc.split("\n\n"):
        text = " ".join(paragraph.split())
        first = paragraph.strip().split("\n")[0]
        if first.startswith(dotted.rsplit(".", 1)[1] + "(") and "\n" not in paragraph.strip():
            continue
        if text.startswith("str -> "):
            text = text[len("str -> "):]
        if text:
            return text
    return dotted


def _parameter_names(func: Any) -> list[str] | None:
    try:
        return list(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # builtins without a text signature
        return None


def tool_catalogue() -> list[Tool]:
    """Every tool, sorted by name (module doc). Each function's parameters as given here are checked against its
    signature where it has one: a name it does not take is a bug here, raised as a RuntimeError."""
    tools = []
    for dotted, params, required, ask in _CATALOGUE:
        func = _resolve(dotted)
        names = _parameter_names(func)
        if names is not None and not set(params) <= set(names):
            raise RuntimeError(f"{dotted} takes {names}, not {sorted(set(params) - set(names))}")
        schema = {"type": "object", "properties": params, "required": list(required), "additionalProperties": False}
        check_schema(schema, dotted)
        spec = {"type": "function", "function": {"name": dotted.replace(".", "_"),
                                                 "description": _description(func, dotted), "parameters": schema}}
        tools.append(Tool(dotted, spec, ask))
    return sorted(tools, key=lambda t: t.name)


def tools_prompts(n: int = 48, seed: int = 0, distractors: int = 3) -> list[dict]:
    """``n`` tool-calling requests (default 48; module doc): every tool of :func:`tool_catalogue` in a seeded
    order, again in another order once all are used, each with ``distractors`` other tools."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of prompts must be an integer >= 1, got {n!r}")
    catalogue = tool_catalogue()
    if not 0 <= distractors < len(catalogue):
        raise ValueError(f"distractors must be between 0 and {len(catalogue) - 1}, got {distractors!r}")
    rows: list[dict] = []
    order: list[Tool] = []
    for i in range(n):
        if not order:
            order = list(catalogue)
            random.Random(f"{seed}:order:{i}").shuffle(order)
        tool = order.pop(0)
        rng = random.Random(f"{seed}:{i}:{tool.name}")
        message, arguments = tool.ask(rng)
        same = [t for t in catalogue if t.module == tool.module and t is not tool]
        others = [t for t in catalogue if t.module != tool.module]
        picked = [_pick(rng, same)] if same and distractors else []
        picked += rng.sample(others, distractors - len(picked))
        offered = [tool, *picked]
        rng.shuffle(offered)
        choice = CATEGORIES[i % len(CATEGORIES)]
        rows.append({"id": f"{choice}/{i:03d}/{tool.name}", "category": choice,
                     "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": message}],
                     "tools": [t.spec for t in offered], "tool_choice": choice, "parallel_tool_calls": False,
                     "expected": {"name": tool.name, "arguments": arguments}})
    return rows


def _arguments(call: Mapping) -> tuple[Any, str | None]:
    args = call.get("arguments")
    if isinstance(args, str):
        return parse_json(args)
    return args, None


def tool_call_errors(call: Any, tools: Sequence[Mapping]) -> list[str]:
    """Why ``call`` is not a valid call of one of ``tools`` (empty when it is): ``call`` is ``{"name",
    "arguments"}`` (OpenAI's ``function`` of a tool call; ``arguments`` a JSON string or an object), valid when
    ``name`` is one of the tools and its arguments parse to an object that matches that tool's parameters."""
    if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
        return ["not a call: expected an object with a 'name' string and 'arguments'"]
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if call["name"] not in by_name:
        return [f"no tool named {call['name']!r} (offered: {', '.join(by_name)})"]
    args, why = _arguments(call)
    if why is not None:
        return [f"arguments {why}"]
    return schema_errors(args, by_name[call["name"]].get("parameters", {"type": "object"}), "$.arguments")


def call_matches(call: Any, expected: Mapping) -> bool:
    """True when ``call`` names the expected tool with exactly the expected arguments (JSON equality)."""
    if not isinstance(call, Mapping) or call.get("name") != expected["name"]:
        return False
    args, why = _arguments(call)
    return why is None and json_equal(args, expected["arguments"])


def tool_calls_report(calls: Sequence[Any] | None, record: Mapping) -> dict:
    """How a reply's tool ``calls`` (OpenAI's ``function`` objects, in order; None or empty: none) answer the
    tools ``record``: ``valid`` (at least one call and every call valid, :func:`tool_call_errors`),
    ``exact`` (the first call is the record's ``expected`` one, :func:`call_matches`; None without one),
    ``errors`` (at most 5)."""
    calls = list(calls or [])
    errors = [e for c in calls for e in tool_call_errors(c, record["tools"])]
    if not calls:
        errors = ["no tool call"]
    expected = record.get("expected")
    exact = None if expected is None else bool(calls) and call_matches(calls[0], expected)
    return {"valid": not errors, "exact": exact,
            "errors": errors[:5]}
