"""Stop strings on streamed text: spanning deltas, overlaps, hold-back and its release."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from myserve.frontend.stop import StopChecker


def run(checker: StopChecker, deltas: list[str]) -> tuple[str, bool]:
    """Feed ``deltas`` until a stop; return the emitted text (flushed if no stop) and whether it stopped."""
    out = []
    for delta in deltas:
        text, stopped = checker.feed(delta)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(checker.flush())
    return "".join(out), False


def test_no_stop_strings_is_a_pass_through() -> None:
    checker = StopChecker([])
    assert checker.feed("Hello") == ("Hello", False)
    assert checker.feed(" wor") == (" wor", False)
    assert checker.held == "" and checker.flush() == ""
    assert checker.matched is None and not checker.stopped
    assert StopChecker([""]).feed("abc") == ("abc", False)  # empty stop strings are ignored


def test_several_stop_strings() -> None:
    checker = StopChecker(["END", "\n\n", "###"])
    assert checker.feed("Hello\n\nworld END") == ("Hello", True)
    assert checker.matched == "\n\n" and checker.stopped


def test_stop_spanning_tiny_deltas() -> None:
    checker = StopChecker(["END"])
    assert checker.feed("Hello E") == ("Hello ", False)
    assert checker.held == "E"
    assert checker.feed("N") == ("", False)
    assert checker.held == "EN"
    assert checker.feed("D and more") == ("", True)
    assert checker.matched == "END"
    # after a stop everything is ignored
    assert checker.feed("more") == ("", True)
    assert checker.flush() == ""


def test_stop_character_by_character() -> None:
    text = "The answer is 42.</answer> trailing"
    assert run(StopChecker(["</answer>"]), list(text)) == ("The answer is 42.", True)


def test_stop_at_the_very_start() -> None:
    checker = StopChecker(["STOP"])
    assert checker.feed("ST") == ("", False)
    assert checker.feed("OP now") == ("", True)
    assert checker.matched == "STOP"
    assert StopChecker(["STOP"]).feed("STOP") == ("", True)


def test_absent_stop_strings_emit_everything() -> None:
    text = "an E, an EN, an ENd and an E"
    checker = StopChecker(["END", "XYZ"])
    assert run(checker, [text[i : i + 3] for i in range(0, len(text), 3)]) == (text, False)
    assert checker.held == "" and checker.matched is None


def test_hold_back_is_released_when_the_partial_match_breaks() -> None:
    checker = StopChecker(["abc"])
    assert checker.feed("xa") == ("x", False)
    assert checker.feed("b") == ("", False)
    assert checker.feed("d") == ("abd", False)
    assert checker.held == ""
    # only the longest suffix that could still match is held: "abab" may continue as "ab|c"
    assert checker.feed("abab") == ("ab", False)
    assert checker.held == "ab"
    assert checker.flush() == "ab"


def test_overlapping_stop_strings_first_completed_wins() -> None:
    checker = StopChecker(["abc", "ab"])
    assert checker.feed("xabc") == ("x", True)
    assert checker.matched == "ab"  # "ab" is complete one character before "abc"
    # completed by the same character: the one that starts first
    checker = StopChecker(["bc", "abc"])
    assert checker.feed("xabcd") == ("x", True)
    assert checker.matched == "abc"
    # generation would stop at "bcd" before "abcdef" could complete, however the text is split
    for deltas in (["zabcdef"], list("zabcdef")):
        checker = StopChecker(["abcdef", "bcd"])
        assert run(checker, deltas) == ("za", True)
        assert checker.matched == "bcd"


def reference(text: str, stop: list[str]) -> tuple[str, str | None]:
    """The text a generator checking after every character would return, and the stop string it hit."""
    stop = [s for s in stop if s]
    for end in range(1, len(text) + 1):
        hits = [s for s in stop if text[:end].endswith(s)]
        if hits:
            longest = max(hits, key=len)
            return text[: end - len(longest)], longest
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc d\n", max_size=40),
    stop=st.lists(st.text(alphabet="abcd\n", min_size=1, max_size=4), max_size=4),
    data=st.data(),
)
def test_random_splits_match_the_reference(text: str, stop: list[str], data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    checker = StopChecker(stop)
    emitted, fed = "", ""
    for delta in deltas:
        out, stopped = checker.feed(delta)
        emitted += out
        fed += delta
        if stopped:
            break
        # nothing is lost, and only a proper prefix of some stop string is held back
        assert emitted + checker.held == fed
        assert checker.held == "" or any(s.startswith(checker.held) and s != checker.held for s in stop)
    else:
        emitted += checker.flush()
    expected, matched = reference(text, stop)
    assert emitted == expected
    assert checker.matched == matched


def test_include_keeps_the_stop_string_and_drops_what_follows() -> None:
    checker = StopChecker(["END"], include=True)
    assert checker.feed("abcE") == ("abc", False)
    assert checker.feed("NDxyz") == ("END", True)
    assert checker.matched == "END"
