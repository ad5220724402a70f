"""The batched sampler: each knob's effect, seeded determinism, penalties against transformers'
logits processors, and logprobs against torch's log_softmax."""

from __future__ import annotations

import pytest
import torch

from shmvllm.model.sampler import Sampler, SamplingMetadata, race_sample, seeded_generator

VOCAB = 8


def _meta(rows: int, temperature: float = 1.0, **kwargs) -> SamplingMetadata:
    temp = torch.full((rows,), temperature)
    greedy = temperature < 1e-5
    return SamplingMetadata(temperature=temp, all_greedy=greedy, all_random=not greedy, **kwargs)


def _sampler(seed: int = 0) -> Sampler:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return Sampler(generator)


def _frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def _draw(meta: SamplingMetadata, rows: int = 20000, seed: int = 0) -> torch.Tensor:
    return _sampler(seed)(LOGITS.repeat(rows, 1), meta).sampled_token_ids


def test_greedy_is_argmax():
    logits = torch.randn(5, 100)
    out = _sampler()(logits.clone(), _meta(5, temperature=0.0)).sampled_token_ids
    assert out.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_random_sampling_follows_softmax_of_scaled_logits(temperature):
    freq = _frequencies(_draw(_meta(20000, temperature)))
    expected = torch.softmax(LOGITS / temperature, -1)
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_race_sample_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.2]]).repeat(30000, 1)
    generator = torch.Generator()
    generator.manual_seed(1)
    tokens = race_sample(probs, {}, generator)
    freq = torch.bincount(tokens, minlength=3).float() / len(tokens)
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.01, rtol=0)


def test_top_k_keeps_k_most_likely_renormalized():
    rows = 20000
    freq = _frequencies(_draw(_meta(rows, top_k=torch.full((rows,), 3))))
    expected = torch.zeros(VOCAB)
    expected[:3] = torch.softmax(LOGITS[:3], -1)
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
    assert freq[3:].sum() == 0


def test_top_p_keeps_the_nucleus():
    probs = torch.softmax(LOGITS, -1)  # 0.39, 0.24, 0.14, 0.09, ...
    rows = 20000
    freq = _frequencies(_draw(_meta(rows, top_p=torch.full((rows,), 0.7))))
    kept = 3  # 0.39 + 0.24 < 0.7 <= 0.39 + 0.24 + 0.14
    assert freq[kept:].sum() == 0
    torch.testing.assert_close(freq[:kept], probs[:kept] / probs[:kept].sum(), atol=0.015, rtol=0)


def test_top_k_and_top_p_per_row():
    rows = 4
    meta = _meta(rows, top_k=torch.tensor([1, VOCAB, 2, VOCAB]), top_p=torch.tensor([1.0, 0.3, 1.0, 1.0]))
    for seed in range(20):
        out = _sampler(seed)(LOGITS.repeat(rows, 1), meta).sampled_token_ids
        assert out[0] == 0 and out[1] == 0 and out[2] in (0, 1)


def test_min_p_drops_unlikely_tokens():
    probs = torch.softmax(LOGITS, -1)
    rows = 20000
    freq = _frequencies(_draw(_meta(rows, min_p=torch.full((rows,), 0.3))))
    keep = probs >= 0.3 * probs.max()
    assert freq[~keep].sum() == 0
    torch.testing.assert_close(freq[keep], probs[keep] / probs[keep].sum(), atol=0.015, rtol=0)


def test_mixed_greedy_and_random_rows():
    meta = SamplingMetadata(temperature=torch.tensor([0.0, 1.0, 0.0]), all_greedy=False, all_random=False)
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 0.0], [9.0, 0.0, 1.0]])
    seen = set()
    for seed in range(30):
        out = _sampler(seed)(logits.clone(), meta).sampled_token_ids.tolist()
        assert out[0] == 1 and out[2] == 0
        seen.add(out[1])
    assert seen == {0, 1, 2}


def _pad(rows: list[list[int]], vocab: int) -> torch.Tensor:
    width = max(max(len(r) for r in rows), 1)
    return torch.tensor([r + [vocab] * (width - len(r)) for r in rows])


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    vocab = 50
    logits = torch.randn(2, vocab) * 3
    prompts, outputs = [[1, 2, 3, 3], [7]], [[4, 1], [8, 9, 9]]
    meta = _meta(2, temperature=0.0, repetition_penalty=torch.tensor([1.3, 0.7]),
                 presence_penalty=torch.zeros(2), frequency_penalty=torch.zeros(2),
                 prompt_token_ids=_pad(prompts, vocab), output_token_ids=_pad(outputs, vocab))
    from shmvllm.model.sampler import apply_penalties

    got = apply_penalties(logits.clone(), meta)
    for row, penalty in enumerate((1.3, 0.7)):
        history = torch.tensor([prompts[row] + outputs[row]])
        expected = RepetitionPenaltyLogitsProcessor(penalty)(history, logits[row : row + 1].clone())
        torch.testing.assert_close(got[row : row + 1], expected, atol=1e-6, rtol=0)


def test_presence_and_frequency_penalties_count_outputs_only():
    from shmvllm.model.sampler import apply_penalties

    vocab = 10
    logits = torch.zeros(1, vocab)
    meta = _meta(1, temperature=0.0, repetition_penalty=torch.ones(1), presence_penalty=torch.tensor([0.5]),
                 frequency_penalty=torch.tensor([0.25]), prompt_token_ids=_pad([[3, 3, 3]], vocab),
                 output_token_ids=_pad([[5, 5, 6]], vocab))
    got = apply_penalties(logits, meta)[0]
    expected = torch.zeros(vocab)
    expected[5] = -(0.5 + 0.25 * 2)
    expected[6] = -(0.5 + 0.25)
    torch.testing.assert_close(got, expected)


def test_penalties_change_the_greedy_choice():
    vocab = 4
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.0]])
    meta = _meta(1, temperature=0.0, repetition_penalty=torch.tensor([1.2]), presence_penalty=torch.zeros(1),
                 frequency_penalty=torch.zeros(1), prompt_token_ids=_pad([[1]], vocab),
                 output_token_ids=_pad([[]], vocab))
    assert _sampler()(logits, meta).sampled_token_ids.tolist() == [2]


def test_min_tokens_masks_stop_tokens():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 2)
    meta = _meta(2, temperature=0.0, stop_token_mask=[(0, [1, 2])])
    assert _sampler()(logits, meta).sampled_token_ids.tolist() == [3, 1]


def test_seeded_rows_ignore_the_rest_of_the_batch():
    vocab = 1000
    row_logits = torch.randn(vocab)

    def draw(rows: int, at: int, position: int, seed: int = 42) -> int:
        logits = torch.randn(rows, vocab)
        logits[at] = row_logits
        meta = _meta(rows, top_p=torch.full((rows,), 0.9), generators={at: seeded_generator(seed, position, torch.device("cpu"))})
        return int(_sampler(rows)(logits, meta).sampled_token_ids[at])

    alone = [draw(1, 0, position) for position in range(12)]
    assert [draw(7, 3, position) for position in range(12)] == alone
    assert [draw(3, 2, position) for position in range(12)] == alone
    assert len(set(alone)) > 1  # the position changes the draw
    assert [draw(1, 0, position, seed=43) for position in range(12)] != alone


def test_logprobs_come_from_raw_logits():
    logits = torch.randn(3, 30) * 2
    expected = torch.log_softmax(logits, -1)
    meta = _meta(3, temperature=0.7, max_num_logprobs=4, repetition_penalty=torch.full((3,), 1.5),
                 presence_penalty=torch.full((3,), 1.0), frequency_penalty=torch.zeros(3),
                 prompt_token_ids=_pad([[1, 2], [3], [4]], 30), output_token_ids=_pad([[5], [], [6, 6]], 30))
    out = _sampler()(logits.clone(), meta)
    assert out.logprob_token_ids.shape == (3, 5)
    assert out.logprob_token_ids[:, 0].tolist() == out.sampled_token_ids.tolist()
    torch.testing.assert_close(out.logprobs, expected.gather(1, out.logprob_token_ids), atol=1e-4, rtol=0)
    assert out.logprob_token_ids[:, 1:].tolist() == expected.topk(4).indices.tolist()
    ranks = (expected > expected.gather(1, out.sampled_token_ids[:, None])).sum(-1) + 1
    assert out.ranks.tolist() == ranks.tolist()


def test_logprobs_zero_gives_only_the_sampled_token():
    logits = torch.randn(2, 10)
    out = _sampler()(logits.clone(), _meta(2, temperature=0.0, max_num_logprobs=0))
    assert out.logprob_token_ids.shape == (2, 1)
    assert out.ranks.tolist() == [1, 1]
