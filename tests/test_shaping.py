"""DAPO's overlong penalty, the informative-group filter and the batch pick of dynamic sampling (hand-computed);
the config checks of the DAPO and failure-isolation fields."""

from pathlib import Path

import numpy as np
import pytest
from ml_collections import ConfigDict

from arpo_jax.assemble import validate as config
from arpo_jax.config import args
from arpo_jax.experience import reward as shaping

TOY = str(Path(__file__).resolve().parents[1] / "configs" / "toy_cpu.py")


def test_overlong_penalty_hand_computed():
    # L_max 100, L_cache 20: free up to 80 tokens, then -1/20 per token, -1 at 100 and beyond (cut responses).
    lengths = [0, 80, 81, 90, 99, 100, 130]
    np.testing.assert_allclose(shaping.overlong_penalty(lengths, max_length=100, buffer_length=20),
                               [0, 0, -0.05, -0.5, -0.95, -1, -1], atol=1e-7)
    np.testing.assert_allclose(shaping.overlong_penalty(lengths, max_length=100, buffer_length=20, factor=0.5),
                               [0, 0, -0.025, -0.25, -0.475, -0.5, -0.5], atol=1e-7)
    # verl's formula, min(-(len - (L_max - L_cache)) / L_cache * factor, 0), on lengths <= L_max.
    verl = [min(-(n - 80) / 20 * 1.0, 0) for n in lengths[:6]]
    np.testing.assert_allclose(shaping.overlong_penalty(lengths[:6], max_length=100, buffer_length=20), verl)
    for bad in (0, 101):
        with pytest.raises(ValueError, match="buffer_length"):
            shaping.overlong_penalty(lengths, max_length=100, buffer_length=bad)


def test_informative_groups():
    scores = np.array([1, 1, 1, 0, 1, 0, 0.5, 0.5, 2, 3, 3, 3], np.float32)
    group = np.array([7, 7, 7, 2, 2, 2, 5, 5, 5, 9, 9, 9])
    valid = np.ones(12, bool)
    valid[8] = False  # group 5's only differing score is a failed trajectory
    ids, inf = shaping.informative_groups(scores, group, valid)
    assert list(ids) == [2, 5, 7, 9] and list(inf) == [True, False, False, False]
    assert list(shaping.informative_groups(scores, group)[1]) == [True, True, False, False]
    # A group with a single valid member has no group-relative signal either.
    assert not shaping.informative_groups([0.0, 1.0], [0, 0], [True, False])[1][0]


def test_pick_groups():
    rounds = [np.array([True, False, True, False]), np.array([False, True, True, True])]
    assert shaping.pick_groups(rounds, 4) == [(0, 0), (0, 2), (1, 1), (1, 2)]  # the first 4 informative
    short = [np.array([True, False, False, False]), np.array([False, True, False, False])]
    assert shaping.pick_groups(short, 4) == [(0, 0), (0, 1), (0, 2), (1, 1)]  # topped up with the earliest others
    assert shaping.pick_groups([np.array([False, False])], 2) == [(0, 0), (0, 1)]
    with pytest.raises(ValueError, match="3 groups drawn, 4 needed"):
        shaping.pick_groups([np.array([True, True, False])], 4)


BAD = [  # (overrides, problem's field, words the message must contain)
    (dict(algorithm__overlong="soft"), "algorithm.overlong", "none | penalty | mask"),
    (dict(algorithm__overlong="penalty"), "algorithm.overlong_buffer_len", "1 .. data.max_response_length (128)"),
    (dict(algorithm__overlong="penalty", algorithm__overlong_buffer_len=129), "algorithm.overlong_buffer_len",
     "129 with algorithm.overlong=penalty"),
    (dict(algorithm__max_extra_rounds=-1), "algorithm.max_extra_rounds", ">= 0"),
    (dict(algorithm__overlong_penalty_factor=-1.0), "algorithm.overlong_penalty_factor", ">= 0"),
    (dict(rollout__failures__max_fraction=1.5), "rollout.failures.max_fraction", "0 <= x <= 1"),
    (dict(rollout__failures__trajectory_timeout_s=-1.0), "rollout.failures.trajectory_timeout_s", "0 (none)"),
    (dict(rollout__failures__max_skipped_steps=-1), "rollout.failures.max_skipped_steps", "0 (never stop)"),
    (dict(rollout__failures__isolate=False, rollout__failures__trajectory_timeout_s=60.0),
     "rollout.failures.trajectory_timeout_s", "rollout.failures.isolate=True"),
]


@pytest.mark.parametrize("overrides, field, words", BAD, ids=[b[1] for b in BAD])
def test_config_checks_name_the_field_and_the_allowed_values(overrides, field, words):
    tree = args.load_config([f"--config={TOY}"]).to_dict()
    config.validate(ConfigDict(tree), check_files=False)  # the defaults pass
    for path, value in overrides.items():
        *parents, leaf = path.split("__")
        node = tree
        for part in parents:
            node = node[part]
        node[leaf] = value
    with pytest.raises(config.ConfigError) as err:
        config.validate(ConfigDict(tree, type_safe=False), check_files=False)
    assert any(p.startswith(field + ":") and words in p and "(allowed:" in p for p in err.value.problems), \
        err.value.problems
