"""The rules every engine shares (rollout/sampler.py): stop detection, finish reasons, request seeds, the interface."""

from arpo_jax.rollout.sampler import Sampler, find_stop, finish_generation, request_seed


def test_find_stop_earliest_match_wins():
    assert find_stop("a </search> b </python>", ("</python>", "</search>")) == (2, "</search>")
    assert find_stop("x </python>", ("</python>", "python>")) == (2, "</python>")  # tie on start: listed first
    assert find_stop("nothing here", ("</python>",)) is None
    assert find_stop("anything", ()) is None and find_stop("anything", ("",)) is None


def test_find_stop_incremental_looks_only_where_a_match_can_end_in_the_new_text():
    text = "</python> then more"
    assert find_stop(text, ("</python>",), new_chars=5) is None  # found before: not reported again
    assert find_stop("abc</pyt" + "hon>", ("</python>",), new_chars=4) == (3, "</python>")  # straddles the border
    assert find_stop("abc</python>", ("</python>",), new_chars=100) == (3, "</python>")


def test_finish_generation_stop_then_eos_then_length():
    stop = ("</python>",)
    assert finish_generation("run </python> x", [5, 6, 7], stop, {2}) == ("run ", "stop", "</python>")
    assert finish_generation("done", [5, 2], stop, {2}) == ("done", "eos", None)
    assert finish_generation("cut", [5, 6], stop, {2}) == ("cut", "length", None)
    assert finish_generation("", [], stop, {2}) == ("", "length", None)


def test_request_seed_depends_only_on_base_position_and_tokens():
    s = request_seed(7, 0, [1, 2, 3])
    assert s == request_seed(7, 0, [1, 2, 3]) and 0 <= s < 2**32
    others = {request_seed(8, 0, [1, 2, 3]), request_seed(7, 1, [1, 2, 3]), request_seed(7, 0, [1, 2, 4]),
              request_seed(7 + 2**32, 0, [1, 2, 3])}
    assert s not in others and len(others) == 4


def test_reset_cache_sleep_and_close_default_to_no_ops():
    class Minimal(Sampler):
        def generate(self, requests, settings):
            return []

    m = Minimal()
    assert m.reset_cache() is None and m.sleep() is None and m.close() is None
    from arpo_jax.rollout.vllm_sampler import VllmSampler  # not a subclass: the trainer calls its sleep too

    assert callable(VllmSampler.sleep)
