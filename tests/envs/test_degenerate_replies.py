"""Degenerate model replies (calls, attributes, subscripts, containers and
operators nested up to 10,000 deep) cannot crash an episode and cannot run
anything: every bound is checked before anything recursive touches the text."""
import ast
import uuid
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rcgrpo.envs.bfcl import Episode
from rcgrpo.envs.calls import MAX_EXPR_DEPTH, _tree_depth, decode_calls, expression_depth_bound
from rcgrpo.envs.executor import REFUSED_NAMES
from tests.hostile import KINDS, AuditLog, wrap

# A few entries whose episodes reach different API classes (MathAPI runs in
# the worker process, the rest in this one).
ENTRY_IDS = ["multi_turn_base_0", "multi_turn_base_50", "multi_turn_base_150", "multi_turn_miss_func_10",
             "multi_turn_long_context_5", "multi_turn_miss_param_120"]
MARKER_DIR = None  # set by the fixture: where a hostile payload would leave a file

SEEDS = st.one_of(
    st.integers(-10**30, 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=20).map(repr),
    st.sampled_from(["None", "True", "ls", "a", "'x'", "ls()", "cd(folder='document')", "pwd()",
                     "add(a=1, b=2)", "__import__('os').system('touch {m}')", "open('{m}', 'w')",
                     "exec('open(\"{m}\", \"w\")')", "eval('1')", "kill()", "ls.__globals__",
                     "f'{{__import__(\"os\").system(\"touch {m}\")}}'", "...", "b'x'", "1j"]),
)


@st.composite
def degenerate_reply(draw, max_depth: int = 10_000) -> str:
    """A reply nesting several forms; their total depth is at most max_depth."""
    layers = draw(st.lists(st.tuples(st.sampled_from(KINDS), st.integers(1, max_depth)), min_size=1, max_size=4))
    budget = draw(st.integers(1, max_depth))
    total = sum(n for _, n in layers)
    expr = draw(SEEDS)
    for kind, n in layers:
        expr = wrap(kind, expr, max(1, n * budget // total))
    shape = draw(st.sampled_from(["[ls(a={e})]", "{e}", "[{e}, pwd()]", "[cd(folder={e}), ls()]", "```{e}```",
                                  "[{e}]", "[add(a={e}, b=1)]"]))
    return shape.format(e=expr).replace("{m}", str(MARKER_DIR / f"pwned_{uuid.uuid4().hex}"))


@pytest.fixture(scope="module")
def fuzz_env(by_id, tmp_path_factory):
    global MARKER_DIR
    MARKER_DIR = tmp_path_factory.mktemp("markers")
    return [by_id[i] for i in ENTRY_IDS], AuditLog(MARKER_DIR)


def check_step(entry, text: str, audit: AuditLog) -> None:
    episode = Episode(entry)
    audit.active = True
    try:
        result = episode.step(text)  # must not raise, whatever the text
    finally:
        audit.active = False
    assert audit.seen == [], audit.seen
    allowed = episode._executor.bound_methods()
    for call in episode._executed:
        assert call.rejected is None and call.name in allowed and call.name not in REFUSED_NAMES, call
    if result.calls:
        assert len(result.tool_messages) == len(result.calls)
    else:
        assert result.turn_ended
    episode.result()  # and the official checker copes with what was recorded
    assert not any(MARKER_DIR.iterdir()), list(MARKER_DIR.iterdir())


@pytest.mark.slow  # 200 hypothesis examples, up to 10,000 deep (~2.2 s)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_degenerate_replies_never_raise_or_run(fuzz_env, data):
    entries, audit = fuzz_env
    entry = data.draw(st.sampled_from(entries))
    check_step(entry, data.draw(degenerate_reply()), audit)


@pytest.mark.parametrize("text", [
    "[ls" + "()" * 330 + "]",                 # the chained-call reply that escaped as RecursionError
    "a" + ".a" * 1000 + "()",                  # an attribute chain 1,000 deep
    "[ls(a=" + "-" * 100_000 + "1)]",        # unary chain
    "[ls(a=" + "[" * 9_999 + "]" * 9_999 + ")]",
    "[ls(a=1" + "+1" * 10_000 + ")]",
])
def test_the_reported_replies_end_the_turn_with_a_reason(fuzz_env, text):
    entries, audit = fuzz_env
    check_step(entries[0], text, audit)
    step = Episode(entries[0]).step(text)
    assert step.turn_ended and "bound" in step.decode_error, step.decode_error


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(degenerate_reply(max_depth=40))
def test_depth_bound_holds_for_every_text_that_parses(text):
    """The pre-parse scan never under-estimates the tree depth it guards."""
    body = text.strip("`\n ")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)  # e.g. "1is 1": text, not our code
            tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return
    assert _tree_depth(tree.body) <= expression_depth_bound(body)


@pytest.mark.slow  # decodes the ground truth of every entry (~3 s)
def test_ordinary_replies_are_far_inside_the_bound(by_id):
    """Every ground-truth call of every entry decodes: the bound costs nothing real."""
    from rcgrpo.envs.reward import ground_truth

    deepest = 0
    for entry in by_id.values():
        for turn in ground_truth(entry).calls:
            text = "[" + ", ".join(c.canonical() for c in turn) + "]"
            deepest = max(deepest, expression_depth_bound(text))
            assert all(c.rejected is None for c in decode_calls(text))
    assert deepest < MAX_EXPR_DEPTH // 2, deepest
