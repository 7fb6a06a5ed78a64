import pytest

from rcgrpo.envs.bfcl import Episode
from rcgrpo.envs.calls import Call


def test_turns_advance_like_the_official_loop(by_id):
    entry = by_id["multi_turn_base_0"]
    ep = Episode(entry)
    assert ep.turn_messages() == entry.turns[0]
    step = ep.step("[cd(folder='document'), mkdir(dir_name='temp')]")
    assert not step.turn_ended and len(step.tool_messages) == 2
    assert step.tool_messages[0]["role"] == "tool" and step.tool_messages[0]["name"] == "cd(folder='document')"
    assert "document" in step.tool_messages[0]["content"]
    step = ep.step("Done! The directory was created.")  # no call: the turn ends
    assert step.turn_ended and not step.done and step.decode_error
    assert ep.turn_index == 1 and ep.turn_messages() == entry.turns[1]
    assert ep.step("[]").turn_ended  # an empty call list ends the turn too
    ep.finish("max_length")
    result = ep.result()
    assert result.end_reason == "max_length" and not result.valid and result.reward == 0.0
    with pytest.raises(RuntimeError):
        ep.step("[ls()]")


def test_miss_func_reveals_held_out_docs_at_its_turn(entries):
    entry = next(e for e in entries if e.category == "miss_func" and min(e.missed_function) > 0)
    reveal_turn = min(entry.missed_function)
    held = set(entry.missed_function[reveal_turn])
    ep = Episode(entry)
    assert not held & {d["name"] for d in ep.visible_function_docs()}
    assert not held & {d["name"] for d in ep.initial_function_docs()}
    while ep.turn_index < reveal_turn:
        ep.end_turn()
    (message,) = ep.turn_messages()
    assert message["role"] == "user"
    assert all(name in message["content"] for name in held)
    assert "I have updated some more functions you can choose from" in message["content"]
    assert held <= {d["name"] for d in ep.visible_function_docs()}
    assert {d["name"] for d in ep.revealed_function_docs()} == held


def test_more_than_twenty_steps_force_terminates(by_id):
    entry = by_id["multi_turn_base_1"]
    ep = Episode(entry)
    for _ in range(20):
        assert not ep.step("[ls()]").done
    last = ep.step("[ls()]")
    assert last.done and last.turn_ended and ep.end_reason == "step_limit"
    result = ep.result()
    assert not result.valid and "force_terminated" in result.verdict_error
    assert result.steps == 21


def test_force_termination_on_the_last_turn_is_still_checked(by_id):
    # Official runner: the turn is recorded, so turn counts match and the
    # checker runs; replaying ground truth then looping keeps it valid.
    from rcgrpo.envs.reward import ground_truth

    entry = by_id["multi_turn_base_1"]
    gt = ground_truth(entry)
    ep = Episode(entry)
    for turn in gt.calls[:-1]:
        ep.step_calls(list(turn))
        ep.end_turn()
    ep.step_calls(list(gt.calls[-1]))
    while not ep.done:
        ep.step("[ls()]")
    assert ep.end_reason == "step_limit" and ep.result().valid


@pytest.mark.slow  # waits out a call's 1 s limit, twice (~2.3 s)
def test_call_that_runs_too_long_is_stopped_and_reported(entries):
    entry = next(e for e in entries if "MathAPI" in e.involved_classes)
    ep = Episode(entry, call_timeout_s=1.0)
    step = ep.step("[power(base=10, exponent=999999999999), logarithm(value=10, base=2, precision=999999999)]")
    assert all("exceeded the 1 s limit" in m["content"] for m in step.tool_messages), step.tool_messages
    # the worker came back: a normal call works right after
    step = ep.step("[add(a=2, b=3)]")
    assert step.tool_messages[0]["content"] == '{"result": 5}'
    ep.result()  # the verdict never runs the timed-out calls


def test_a_worker_call_that_raises_is_worded_like_an_in_process_one(entries):
    entry = next(e for e in entries if "MathAPI" in e.involved_classes)
    step = Episode(entry).step("[add(a=2)]")  # MathAPI runs in the worker process
    text = step.tool_messages[0]["content"]
    assert text.startswith("Error during execution: ") and "missing 1 required positional argument" in text


def test_errors_come_back_as_tool_text(by_id):
    ep = Episode(by_id["multi_turn_base_0"])
    step = ep.step("[cd(folder='nowhere'), sort(), not_a_function(x=1), cd.x()]")
    texts = [m["content"] for m in step.tool_messages]
    assert texts[0].startswith('{"error"') and "nowhere" in texts[0]
    assert texts[1].startswith("Error during execution: ") and "missing 1 required positional argument" in texts[1]
    assert "not one of the available functions" in texts[2]
    assert "not a plain function name" in texts[3]
    assert not step.turn_ended


def test_positional_arguments_dropped_or_bound():
    from rcgrpo.envs.calls import decode_calls

    def sort(file_name: str):
        return file_name

    assert decode_calls("sort('a.txt')", {"sort": sort}) == [Call("sort", {})]
    assert decode_calls("sort('a.txt')", {"sort": sort}, positional="bind") == [Call("sort", {"file_name": "a.txt"})]
    (bad,) = decode_calls("sort('a', 'b')", {"sort": sort}, positional="bind")
    assert bad.rejected
