"""The gate of engines that load staged weights later: ``verify_staged_probes`` (engine probes
against the trainer's log-probs kept from the push) and ``engine_self_check`` (sampler vs scoring)."""

from __future__ import annotations

import pytest
import torch

from megatron_empg.weight_sync.gate import ConsistencyError, engine_self_check, probe_batch, verify_staged_probes

VOCAB, N, L, C = 11, 3, 6, 4  # probe sequences of L tokens, C sampled after each
# a bigram "model": log p(next | previous), so log-probs are a fixed function of the sequence
TABLE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float64).log_softmax(-1)


def model_logprobs(sequences) -> torch.Tensor:
    """[N, T-1] float64 log-probs of tokens 1 .. T-1 under the bigram model."""
    seqs = torch.tensor(sequences)
    return TABLE[seqs[:, :-1], seqs[:, 1:]]


class FakeEngine:
    """Scores with the bigram model, plus ``errors`` {(sequence, column): added log-prob}."""

    def __init__(self, errors: dict[tuple[int, int], float] | None = None) -> None:
        self.errors = errors or {}
        self.scored = 0

    def score(self, sequences) -> list[list[float]]:
        self.scored += 1
        logprobs = model_logprobs(sequences)
        for (seq, col), error in self.errors.items():
            logprobs[seq, col] += error
        return logprobs.tolist()


PROBE = probe_batch(N, L, VOCAB, seed=1)
# the probe followed by its "sampled" continuation: what engine_probe returns as sequences
SEQUENCES = [seq + cont for seq, cont in zip(PROBE, probe_batch(N, C, VOCAB, seed=2))]
TRAINER = model_logprobs(PROBE)  # [N, L-1]: the trainer's log-probs kept from the push


def engine_result(errors=None):
    """(sequences, [N, L+C-1] log-probs) of one engine, as ``engine_probe`` gives them."""
    return SEQUENCES, torch.tensor(FakeEngine(errors).score(SEQUENCES), dtype=torch.float64)


class Counter:
    def __init__(self, result) -> None:
        self.calls, self.result = 0, result

    def __call__(self):
        self.calls += 1
        return self.result


def test_probes_matching_the_trainer_pass_with_their_max_difference():
    diagnose = Counter({})
    probes = [engine_result(), engine_result({(1, 2): 3e-6})]
    diff = verify_staged_probes(probes, [0.0, 0.0], TRAINER, "step-5", tolerance=1e-4, diagnose=diagnose)
    assert diff == pytest.approx(3e-6, rel=1e-6)
    assert diagnose.calls == 0


def test_a_mismatching_engine_is_named_and_diagnosed_once():
    diagnose = Counter({"attention.qkv": 0.25, "mlp": 0.0})
    probes = [engine_result({(0, 1): 0.1}), engine_result({(2, 3): 0.5})]  # engine 1 is the worst
    with pytest.raises(ConsistencyError) as error:
        verify_staged_probes(probes, [0.0, 0.0], TRAINER, "step-7", tolerance=1e-4, diagnose=diagnose)
    message = str(error.value)
    assert "weight sync step-7: engine 1 and trainer log-probs differ by up to 0.5" in message
    assert "probe sequence 2, token 4" in message  # column 3 is the log-prob of token 4
    assert "worst tensor family: attention.qkv" in message
    assert diagnose.calls == 1


def test_a_mismatch_without_diagnose_says_none_ran():
    with pytest.raises(ConsistencyError, match="engine 0 and trainer .* no layout diagnosis was run"):
        verify_staged_probes([engine_result({(0, 0): 1.0})], [0.0], TRAINER, "step-1", tolerance=1e-4)


def test_a_self_check_above_tolerance_blames_the_prefix_cache_of_that_engine():
    diagnose = Counter({})
    probes = [engine_result(), engine_result()]
    with pytest.raises(ConsistencyError) as error:
        verify_staged_probes(probes, [0.0, 0.3], TRAINER, "step-3", tolerance=1e-3, diagnose=diagnose)
    message = str(error.value)
    assert "weight sync step-3" in message and "engine 1" in message and "prefix cache" in message
    assert "0.3" in message
    # scoring matches the trainer, so the layout is not in question: no diagnosis
    assert diagnose.calls == 0


@pytest.mark.parametrize(
    "probe_error, self_checks, expected",
    [(3e-6, [2e-5, 1e-5], 2e-5), (3e-5, [2e-6, 1e-5], 3e-5)],
    ids=["self-check-larger", "probe-larger"],
)
def test_self_checks_within_tolerance_count_in_the_max_difference(probe_error, self_checks, expected):
    probes = [engine_result(), engine_result({(0, 4): probe_error})]
    diff = verify_staged_probes(probes, self_checks, TRAINER, "step-2", tolerance=1e-3)
    assert diff == pytest.approx(expected, rel=1e-6)


def test_only_the_probe_columns_of_longer_engine_log_probs_are_compared():
    # columns from L-1 on are the sampled continuation: the trainer's kept log-probs do not cover them
    errors = {(0, L - 1): 5.0, (2, L + C - 2): 7.0, (1, L - 2): 2e-6}
    diff = verify_staged_probes([engine_result(errors)], [0.0], TRAINER, "step-4", tolerance=1e-4)
    assert diff == pytest.approx(2e-6, rel=1e-6)  # the last probe column is still compared


def test_self_check_of_an_engine_that_agrees_with_its_sampler_is_zero():
    sequences, logprobs = engine_result()
    engine = FakeEngine()
    assert engine_self_check(engine, sequences, logprobs, L) == 0.0
    assert engine.scored == 1


@pytest.mark.parametrize("column", [L - 1, L + C - 2], ids=["first-sampled", "last-sampled"])
def test_self_check_finds_a_gap_on_the_sampled_continuation(column):
    sequences, logprobs = engine_result()
    assert engine_self_check(FakeEngine({(1, column): 0.2}), sequences, logprobs, L) == pytest.approx(0.2)


def test_self_check_ignores_gaps_on_the_probe_itself():
    # the probe's own log-probs are the trainer's to check, not the self-check's
    sequences, logprobs = engine_result()
    engine = FakeEngine({(0, L - 2): 0.2, (2, 0): 0.4})
    assert engine_self_check(engine, sequences, logprobs, L) == 0.0


def test_self_check_without_a_continuation_is_zero_and_scores_nothing():
    logprobs = model_logprobs(PROBE)  # [N, L-1]: no token was sampled
    engine = FakeEngine({(0, 0): 1.0, (1, L - 2): 1.0})
    assert engine_self_check(engine, PROBE, logprobs, L) == 0.0
    assert engine.scored == 0


@pytest.mark.parametrize("engines, named", [([2], "engine 2"), (None, "engine 0")], ids=["named", "default"])
def test_the_deferred_gate_names_the_engine_and_the_version_that_failed(engines, named):
    """The trainer gates one engine's probe at a time (``DisaggregatedEngines._check_probes``):
    the error names that engine's index in the run, not its place in a list of one."""
    with pytest.raises(ConsistencyError) as error:
        verify_staged_probes([engine_result({(0, 0): 1.0})], [0.0], TRAINER, "step-6", tolerance=1e-4, engines=engines)
    assert str(error.value).startswith(f"weight sync step-6: {named} and trainer log-probs differ")
    with pytest.raises(ConsistencyError, match=f"weight sync step-6: {named}'s sampler"):
        verify_staged_probes([engine_result()], [0.5], TRAINER, "step-6", tolerance=1e-4, engines=engines)
