"""Safe decoding of model text into tool calls: `ast` only, never `eval`.

BFCL's prompting format is python call syntax: `[f(a=1), g(b='x')]`. The
official decoder (`bfcl_eval.model_handler.utils.default_decode_execute_prompting`)
strips backticks, newlines and spaces from both ends, wraps the text in
brackets, parses it with `ast`, and then `eval`s some argument expressions and
the whole call string. Model output is untrusted, so here:

* before `ast.parse` sees the text, a linear scan bounds its size and how
  deep its expression tree can be (`expression_depth_bound`); after parsing,
  an iterative walk checks the real depth. Only then does anything recurse
  over the tree, so no reply can raise RecursionError or exhaust the parser;
* the text is parsed with `ast.parse` and walked by hand; only literal values
  (str/int/float/bool/None and lists, tuples, dicts of them, negated numbers)
  and bare identifiers (which the official decoder turns into their name as a
  string) are accepted as argument values;
* a syntax error, or a list element that is not a call, is a `DecodeError`:
  the official loop treats that as "no call" and ends the turn;
* a call that parses but is unsafe or unknown (attribute access, a call or an
  operator inside an argument, a lambda, a comprehension, a huge literal, a
  name outside the entry's methods) becomes a `Call` with `rejected` set: it is
  never executed, and the model sees the reason as that call's error result;
* positional arguments are dropped, exactly as the official decoder does
  (`positional="drop"`), or bound to parameter names (`positional="bind"`, a
  tolerant mode, and what ground-truth strings need).
"""
from __future__ import annotations

import ast
import inspect
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

Positional = Literal["drop", "bind"]

# Bounds on what a decoded argument may hold: one model step must not be able
# to make the environment allocate or compute without limit.
MAX_TEXT_CHARS = 200_000
MAX_INT_BITS = 63
MAX_STR_CHARS = 100_000
MAX_ELEMENTS = 10_000
MAX_DEPTH = 16
# Bound on the depth of a whole reply's expression tree (calls, attributes,
# subscripts, operators, containers). Real calls stay under 10; 100 keeps
# every recursive walk (ours, `ast`'s, the checker's) far from Python's
# recursion limit wherever in the stack the environment is driven from.
MAX_EXPR_DEPTH = 100

_OPERATOR_CHARS = frozenset("+-*/%@&|^~<>=!.")
_OPERATOR_WORDS = frozenset({"not", "and", "or", "if", "else", "lambda", "in", "is", "await", "yield", "for"})
_OPEN, _CLOSE = "([{", ")]}"
_FSTRING_CODE = _OPERATOR_CHARS | frozenset(_OPEN)  # counted inside an f-string
_NUMBER = re.compile(r"0[xXoObB][0-9a-fA-F_]*|\d[\d_]*(\.[\d_]*)?([eE][+-]?[\d_]+)?[jJ]?")


class DecodeError(ValueError):
    """The text is not a python call list: the official loop ends the turn."""


class UnsafeArgument(ValueError):
    """An argument is not a bounded literal: the call is rejected, not run."""


@dataclass(frozen=True)
class Call:
    """One decoded call. `kwargs` holds only literal values."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Positional values as written; used only by positional="bind".
    args: tuple[Any, ...] = ()
    # Why the call must not run (None for a call that may run).
    rejected: str | None = None

    def canonical(self) -> str:
        """A call string that `eval` can only read literals from.

        `repr` of the decoded literals gives python literal syntax back, so the
        official checker (which evals call strings) runs exactly the method
        and arguments decoded here, and nothing else.
        """
        if self.rejected is not None:
            raise ValueError(f"rejected call has no canonical form: {self.rejected}")
        inner = ", ".join(f"{k}={_literal_repr(v)}" for k, v in self.kwargs.items())
        return f"{self.name}({inner})"


def decode_calls(
    text: str,
    allowed: Mapping[str, Callable[..., Any]] | None = None,
    positional: Positional = "drop",
) -> list[Call]:
    """Decode one assistant message into calls.

    `allowed` maps the entry's method names to the bound methods (used to
    restrict names and, for positional="bind", to find parameter names); with
    None every plain name is accepted (used for trusted ground truth).
    Raises `DecodeError` when the text is not a call list at all.
    """
    if not isinstance(text, str):
        raise DecodeError(f"expected text, got {type(text).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise DecodeError(f"message of {len(text)} characters exceeds {MAX_TEXT_CHARS}")
    # Same normalisation as the official decoder, so the same texts decode.
    body = text.strip("`\n ")
    if not body.startswith("["):
        body = "[" + body
    if not body.endswith("]"):
        body = body + "]"
    body = body.strip().strip("'")
    bound = expression_depth_bound(body)
    if bound > MAX_EXPR_DEPTH:
        raise DecodeError(f"reply nests up to {bound} levels deep, over the bound of {MAX_EXPR_DEPTH}; not parsed")
    try:
        with warnings.catch_warnings():
            # Model text like "1abc" or "'\R'" makes the parser warn; it is data, not code.
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise DecodeError(f"not a python call list: {type(exc).__name__}: {exc}") from None
    depth = _tree_depth(tree)
    if depth > MAX_EXPR_DEPTH:
        raise DecodeError(f"reply's expression tree is {depth} levels deep, over the bound of {MAX_EXPR_DEPTH}")
    nodes = [tree] if isinstance(tree, ast.Call) else getattr(tree, "elts", None)
    if nodes is None:
        raise DecodeError(f"expected a list of calls, got {type(tree).__name__}")
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call):
            raise DecodeError(f"list element is a {type(node).__name__}, not a call")
        calls.append(_decode_call(node, body, allowed, positional))
    return calls


def expression_depth_bound(text: str) -> int:
    """An upper bound on the depth of the expression tree `text` parses to,
    found by one linear scan (no parser, no recursion).

    Each bracket group adds a level; inside a group, each comma-separated
    element may chain operators, attribute dots, calls and subscripts, each
    adding at most one level, so an element's depth is at most its count of
    those plus its deepest group. String contents are skipped (f-strings,
    whose braces hold code, count every operator-like character instead).
    Unbalanced text is bounded as far as it goes; the parser rejects it.
    """
    # One frame per open group: [ops in the current element, deepest group
    # in it, deepest element so far].
    stack = [[0, 0, 0]]
    after_atom = False  # a '(' or '[' here is a call or subscript of what precedes
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "'\"" or (ch in "rRbBuUfF" and _string_start(text, i)):
            i, after_atom = _skip_string(text, i, stack[-1]), True
            continue
        if ch.isalpha() or ch == "_":
            j = i
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            word = text[i:j] in _OPERATOR_WORDS
            stack[-1][0] += word
            i, after_atom = j, not word
            continue
        number = _NUMBER.match(text, i) if ch.isdigit() else None
        if number:  # its '.', exponent and sign are not operators
            i, after_atom = number.end(), True
            continue
        if ch.isspace():
            i += 1
            continue
        if ch in _OPEN:
            stack[-1][0] += after_atom and ch != "{"  # the call/subscript node
            stack.append([0, 0, 0])
        elif ch in _CLOSE and len(stack) > 1:
            ops, child, best = stack.pop()
            group = max(best, ops + child) + 1
            stack[-1][1] = max(stack[-1][1], group)
        elif ch == ",":
            top = stack[-1]
            top[2] = max(top[2], top[0] + top[1])
            top[0] = top[1] = 0
        elif ch in _OPERATOR_CHARS:
            stack[-1][0] += 1
        after_atom = ch in _CLOSE
        i += 1
    # Groups left open still count to their current depth; +1 for the
    # leaves' context nodes (Load).
    depth = 0
    for ops, child, best in reversed(stack):
        depth = max(best, ops + max(child, depth)) + 1
    return depth + 1


def _string_start(text: str, i: int) -> bool:
    """Whether a string prefix (r, b, f, u, rb, ...) starts at `i`."""
    j = i
    while j < len(text) and j - i < 2 and text[j] in "rRbBuUfF":
        j += 1
    return j < len(text) and text[j] in "'\"" and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_"))


def _skip_string(text: str, i: int, frame: list) -> int:
    """Index just past the string literal starting at `i` (prefix included)."""
    j = i
    while text[j] not in "'\"":
        j += 1
    prefix = text[i:j].lower()
    quote = text[j] * 3 if text.startswith(text[j] * 3, j) else text[j]
    j += len(quote)
    n = len(text)
    while j < n and not text.startswith(quote, j):
        if "f" in prefix and text[j] in _FSTRING_CODE:
            frame[0] += 1  # code inside an f-string's braces
        j += 2 if text[j] == "\\" else 1  # even in a raw string, \' does not end it
    return j + len(quote)


def _tree_depth(tree: ast.AST) -> int:
    """Depth of a parsed tree, walked with an explicit stack."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth <= MAX_EXPR_DEPTH:  # past the bound the answer is already known
            stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def bind_positional(call: Call, method: Callable[..., Any]) -> Call:
    """Give positional values their parameter names (ground truth uses them)."""
    if not call.args:
        return call
    params = [
        p.name
        for p in inspect.signature(method).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(call.args) > len(params):
        return Call(call.name, call.kwargs, call.args,
                    rejected=f"{call.name}() takes {len(params)} positional arguments "
                             f"but {len(call.args)} were given")
    bound = dict(zip(params, call.args))
    clash = sorted(set(bound) & set(call.kwargs))
    if clash:
        return Call(call.name, call.kwargs, call.args,
                    rejected=f"{call.name}() got multiple values for {clash}")
    return Call(call.name, {**bound, **call.kwargs})


def _decode_call(node: ast.Call, source: str, allowed, positional: Positional) -> Call:
    if not isinstance(node.func, ast.Name):
        # The text as written (no unparse: nothing recursive on model output).
        what = (ast.get_source_segment(source, node.func) or type(node.func).__name__)[:80]
        return Call(what, rejected=f"'{what}' is not a plain function name")
    name = node.func.id
    if allowed is not None and name not in allowed:
        return Call(name, rejected=f"'{name}' is not one of the available functions")
    try:
        budget = [MAX_ELEMENTS]
        kwargs = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise UnsafeArgument("'**' unpacking is not allowed")
            kwargs[kw.arg] = _literal(kw.value, 0, budget)
        args = tuple(_literal(a, 0, budget) for a in node.args)
    except UnsafeArgument as exc:
        return Call(name, rejected=f"unsafe argument in {name}(): {exc}")
    if not args:
        return Call(name, kwargs)
    if positional == "drop":
        return Call(name, kwargs)
    if allowed is None:
        return Call(name, kwargs, args)  # caller binds with the real method later
    return bind_positional(Call(name, kwargs, args), allowed[name])


def _literal(node: ast.AST, depth: int, budget: list[int]) -> Any:
    if depth > MAX_DEPTH:
        raise UnsafeArgument(f"nesting deeper than {MAX_DEPTH}")
    budget[0] -= 1
    if budget[0] < 0:
        raise UnsafeArgument(f"more than {MAX_ELEMENTS} values")
    if isinstance(node, ast.Constant):
        return _bounded_constant(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand, depth + 1, budget)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UnsafeArgument("sign applied to a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_literal(e, depth + 1, budget) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise UnsafeArgument("'**' unpacking is not allowed")
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _literal(k, depth + 1, budget)
            if isinstance(key, (list, dict)):
                raise UnsafeArgument("unhashable dict key")
            out[key] = _literal(v, depth + 1, budget)
        return out
    if isinstance(node, ast.Name):
        # The official decoder reads a bare identifier as its name string.
        return node.id
    raise UnsafeArgument(f"{type(node).__name__} is not a literal")


def _bounded_constant(value: Any) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise UnsafeArgument(f"integer literal wider than {MAX_INT_BITS} bits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UnsafeArgument("non-finite float literal")
        return value
    if isinstance(value, str):
        if len(value) > MAX_STR_CHARS:
            raise UnsafeArgument(f"string literal longer than {MAX_STR_CHARS} characters")
        return value
    # bytes, complex, Ellipsis: nothing in BFCL takes them.
    raise UnsafeArgument(f"{type(value).__name__} literal is not supported")


def _literal_repr(value: Any) -> str:
    # repr of these types is valid python literal syntax; floats were checked
    # finite at decode time, so no 'inf'/'nan' names can appear.
    return repr(value)
