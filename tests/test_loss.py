"""Chain alignment and the loss against hand-written references."""

import pytest
import torch
import torch.nn.functional as F

from occamy_mtp.model.loss import IGNORE, chain_batch, chain_loss
from occamy_mtp.testing.numerics import assert_close, rounding_bound


def test_chain_batch_alignment_by_hand():
    # One row of length 7, assistant span from position 3; a padded second row of length 5.
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 0, 0]])
    greedy = torch.tensor([[30, 31, 32, 33, 34, 35, 36], [40, 41, 42, 43, 44, 0, 0]])
    assistant = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    lengths = torch.tensor([7, 5])
    batch = chain_batch(input_ids, greedy, assistant, lengths, steps=2)
    I = IGNORE
    # step 1 at anchor i embeds x_{i+1}; label greedy_{i+1} where i+2 is in the span.
    assert batch.step_token_ids[0, 0].tolist() == [11, 12, 13, 14, 15, 16, 0]
    assert batch.labels[0, 0].tolist() == [I, 32, 33, 34, 35, I, I]
    assert batch.data_labels[0].tolist() == [I, 13, 14, 15, 16, I, I]
    # step 2 embeds greedy_{i+1}; label greedy_{i+2} where i+3 is in the span.
    assert batch.step_token_ids[1, 0].tolist() == [31, 32, 33, 34, 35, 36, 0]
    assert batch.labels[1, 0].tolist() == [32, 33, 34, 35, I, I, I]
    # the padded row: nothing is scored at or beyond its length
    assert batch.labels[0, 1].tolist() == [41, 42, 43, I, I, I, I]
    assert batch.labels[1, 1].tolist() == [42, 43, I, I, I, I, I]
    assert batch.data_labels[1].tolist() == [22, 23, 24, I, I, I, I]


class _Head:
    def __init__(self, weight):
        self.weight = weight
        self.vocab_size = weight.shape[0]

    def logits(self, hidden):
        return hidden @ self.weight.T


@pytest.mark.parametrize("chunk_tokens", [4096, 3])
def test_chain_loss_matches_reference(chunk_tokens):
    torch.manual_seed(0)
    vocab, dim = 11, 5
    head = _Head(torch.randn(vocab, dim))
    hidden = torch.randn(2, 3, 4, dim, requires_grad=True)  # (K, B, T, D)
    labels = torch.randint(0, vocab, (2, 3, 4))
    labels[0, 0, :2] = IGNORE
    labels[1, 2] = IGNORE
    weights = (0.75, 0.25)
    loss, stats = chain_loss(head, hidden, labels, weights, chunk_tokens=chunk_tokens)
    reference = 0.0
    for k in range(2):
        keep = labels[k] != IGNORE
        reference = reference + weights[k] * F.cross_entropy(head.logits(hidden[k][keep]), labels[k][keep])
    # float32: a log-softmax over the vocabulary, then a weighted mean over the scored pairs.
    assert_close(loss, reference, rounding_bound(reference, torch.float32, reductions=3, width=labels.numel()), "loss")
    assert [s.scored for s in stats] == [int((labels[k] != IGNORE).sum()) for k in range(2)]
    assert [s.agree for s in stats] == [
        int((head.logits(hidden[k][labels[k] != IGNORE]).argmax(-1) == labels[k][labels[k] != IGNORE]).sum()) for k in range(2)]
    grad, = torch.autograd.grad(loss, hidden)
    ref_grad, = torch.autograd.grad(reference, hidden)
    assert_close(grad, ref_grad, rounding_bound(ref_grad, torch.float32, reductions=3, width=vocab), "d loss / d hidden")


def test_chain_loss_without_scored_pairs_still_has_a_graph():
    head = _Head(torch.randn(7, 3))
    hidden = torch.randn(1, 1, 4, 3, requires_grad=True)
    loss, stats = chain_loss(head, hidden, torch.full((1, 1, 4), IGNORE), (1.0,))
    loss.backward()
    assert float(loss.detach()) == 0.0 and hidden.grad is not None and stats[0].scored == 0


@pytest.mark.parametrize("kind", ["kl", "tv"])
@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, 0.8, 0), (1.0, 1.0, 4), (0.0, 1.0, 0)])
def test_distribution_losses_match_a_plain_reference(kind, temperature, top_p, top_k):
    """kl and tv, pair by pair in float64: step k at anchor i fits the base's processed p from
    H_{i+k} (the base's greedy label's own hidden state), q the head's softmax at the temperature."""
    from occamy_mtp.config import Serving
    from occamy_mtp.model.loss import Objective

    torch.manual_seed(1)
    vocab, dim, steps = 11, 5, 2
    head = _Head(torch.randn(vocab, dim) * 2)
    hidden = torch.randn(steps, 3, 6, dim, requires_grad=True)  # (K, B, T, D)
    base_hidden = torch.randn(3, 6, dim)
    labels = torch.randint(0, vocab, (steps, 3, 6))
    labels[:, :, -steps:] = IGNORE  # step k at anchor i reads H_{i+k}: inside the row
    labels[0, 0, :2] = IGNORE
    weights = (0.6, 0.4)
    objective = Objective(kind, Serving(temperature=temperature, top_p=top_p, top_k=top_k))
    loss, stats = chain_loss(head, hidden, labels, weights, chunk_tokens=4, objective=objective, base_hidden=base_hidden)

    from test_sampling import plain_processed

    scale = temperature if temperature > 0 else 1.0
    reference = torch.zeros((), dtype=torch.float64)
    for k in range(steps):
        terms = []
        for b, i in (labels[k] != IGNORE).nonzero().tolist():
            p = torch.tensor(plain_processed(head.logits(base_hidden[b, i + k + 1]).double().tolist(), temperature, top_p, top_k),
                             dtype=torch.float64)
            log_q = (head.logits(hidden[k, b, i]).double() / scale).log_softmax(-1)
            if kind == "kl":
                terms.append(sum(p[x] * (torch.log(p[x]) - log_q[x]) for x in range(vocab) if p[x] > 0))
            else:
                terms.append(1 - torch.minimum(p, log_q.exp()).sum())
        reference = reference + weights[k] * torch.stack(terms).mean()
    # float32 work: the processed p and q (a softmax each over the vocabulary), then sums over the pairs
    assert_close(loss, reference, rounding_bound(reference, torch.float32, reductions=4, width=labels.numel() * vocab), "loss")
    assert [s.scored for s in stats] == [int((labels[k] != IGNORE).sum()) for k in range(steps)]
    grad, = torch.autograd.grad(loss, hidden)
    ref_grad, = torch.autograd.grad(reference, hidden)
    assert float(ref_grad.abs().max()) > 1e-3  # the loss reaches the head
    assert_close(grad, ref_grad.float(), rounding_bound(ref_grad, torch.float32, reductions=4, width=vocab), "d loss / d hidden")


def test_a_distribution_loss_needs_the_base_hidden_states():
    from occamy_mtp.config import Serving
    from occamy_mtp.model.loss import Objective

    head = _Head(torch.randn(7, 3))
    with pytest.raises(ValueError, match="needs the base's hidden states"):
        chain_loss(head, torch.randn(1, 1, 4, 3), torch.zeros(1, 1, 4, dtype=torch.long), (1.0,),
                   objective=Objective("tv", Serving(temperature=0.7)))


def test_a_loss_added_as_a_row_is_taken_by_the_config_and_the_chain(monkeypatch):
    """`losses.LOSSES` is the one place a loss is named: a row added there is a valid `train.loss`, its
    function scores the chain (with p where it fits the distribution), its bytes size the chunks."""
    from occamy_mtp import losses
    from occamy_mtp.config import ConfigError, Serving, check, load_config
    from occamy_mtp.model.loss import Objective

    seen = {}

    def squared(logits, target, p, temperature):
        seen.update(p=p, temperature=temperature)
        return ((logits.softmax(-1) - p) ** 2).sum()

    sampled = ["eval.serving=[{temperature: 0.7}]"]  # a distribution loss fits a sampled configuration's p
    with pytest.raises(ConfigError, match="train.loss: expected top1, top1-certainty, top1-margin, kl or tv"):
        check(load_config(None, ["train.loss=squared", *sampled]))
    monkeypatch.setitem(losses.LOSSES, "squared", losses.Loss("squared", losses.DISTRIBUTION, 64, squared, "sum of (q - p)^2"))
    check(load_config(None, ["train.loss=squared", *sampled]))  # a name now
    head = _Head(torch.randn(7, 3))
    hidden, base_hidden = torch.randn(1, 1, 4, 3), torch.randn(1, 4, 3)
    labels = torch.tensor([[[1, 2, IGNORE, IGNORE]]])
    total, stats = chain_loss(head, hidden, labels, (1.0,), chunk_tokens=8, objective=Objective("squared", Serving(temperature=0.7)),
                              base_hidden=base_hidden)
    assert seen["p"].shape == (2, 7) and seen["temperature"] == 0.7 and torch.allclose(seen["p"].sum(-1), torch.ones(2))
    assert stats[0].scored == 2 and float(total) == pytest.approx(stats[0].loss_sum / 2)


@pytest.mark.parametrize("kind", ["kl", "tv", "top1-certainty", "top1-margin"])
@pytest.mark.parametrize("penalties", [(0.0, 0.0, 1.0), (1.5, 0.0, 1.0), (0.5, 0.4, 1.3)])
def test_losses_that_read_p_match_a_plain_reference_under_penalties(kind, penalties):
    """Every loss that reads p, pair by pair in float64 from the definitions: step k at anchor i reads the
    base's p from H_{i+k+1}, penalized over the answer before x_{i+k+2} (vLLM's penalties, test_penalties'
    plain_penalized) and processed (test_sampling's plain_processed); top1-certainty weighs the
    cross-entropy towards the label by p's top, top1-margin by p's top less p at the head's argmax."""
    from test_penalties import plain_penalized
    from test_sampling import plain_processed

    from occamy_mtp.config import Serving
    from occamy_mtp.model.loss import Objective, Texts

    presence, frequency, repetition = penalties
    serving = Serving(temperature=0.8, top_p=0.9, top_k=6, presence_penalty=presence, frequency_penalty=frequency,
                      repetition_penalty=repetition)
    torch.manual_seed(2)
    vocab, dim, steps, length = 9, 5, 2, 10
    head = _Head(torch.randn(vocab, dim) * 2)
    hidden = torch.randn(steps, 2, length, dim, requires_grad=True)
    base_hidden = torch.randn(2, length, dim)
    input_ids = torch.randint(0, 6, (2, length))  # the answers repeat some tokens, and meet others for the first time
    starts = torch.tensor([3, 5])
    labels = torch.full((steps, 2, length), IGNORE)
    for k in range(steps):
        for b in range(2):
            for i in range(int(starts[b]) - 2, length - k - 2):  # x_{i+k+2} inside the answer and the row
                labels[k, b, i] = int(torch.randint(0, vocab, ()))
    weights = (0.7, 0.3)
    loss, stats = chain_loss(head, hidden, labels, weights, chunk_tokens=3, objective=Objective(kind, serving),
                             base_hidden=base_hidden, texts=Texts(input_ids, starts))

    reference = torch.zeros((), dtype=torch.float64)
    for k in range(steps):
        terms = []
        for b, i in (labels[k] != IGNORE).nonzero().tolist():
            ids, start, at = input_ids[b].tolist(), int(starts[b]), i + k + 2
            raw = head.logits(base_hidden[b, i + k + 1]).double().tolist()
            p = torch.tensor(plain_processed(plain_penalized(raw, ids[start:at], ids[:start], presence, frequency, repetition),
                                             serving.temperature, serving.top_p, serving.top_k), dtype=torch.float64)
            logits = head.logits(hidden[k, b, i]).double()
            log_q = (logits / serving.temperature).log_softmax(-1)
            cross_entropy = -logits.log_softmax(-1)[int(labels[k, b, i])]
            if kind == "kl":
                terms.append(sum(p[x] * (torch.log(p[x]) - log_q[x]) for x in range(vocab) if p[x] > 0))
            elif kind == "tv":
                terms.append(1 - torch.minimum(p, log_q.exp()).sum())
            elif kind == "top1-certainty":
                terms.append(p.max() * cross_entropy)
            else:
                terms.append((p.max() - p[int(logits.argmax())]) * cross_entropy)
        reference = reference + weights[k] * torch.stack(terms).mean()
    assert_close(loss, reference, rounding_bound(reference, torch.float32, reductions=4, width=labels.numel() * vocab), "loss")
    grad, = torch.autograd.grad(loss, hidden)
    ref_grad, = torch.autograd.grad(reference, hidden)
    assert float(ref_grad.abs().max()) > 1e-3  # the loss reaches the head
    assert_close(grad, ref_grad.float(), rounding_bound(ref_grad, torch.float32, reductions=4, width=vocab), "d loss / d hidden")
    if presence:  # the penalties change p, so a loss that ignored them would fail above
        unpenalized, _ = chain_loss(head, hidden, labels, weights, chunk_tokens=3,
                                    objective=Objective(kind, Serving(temperature=0.8, top_p=0.9, top_k=6)),
                                    base_hidden=base_hidden)
        assert abs(float(unpenalized.detach()) - float(reference.detach())) > 1e-4


def test_a_loss_that_reads_p_under_penalties_needs_the_texts():
    from occamy_mtp.config import Serving
    from occamy_mtp.model.loss import Objective

    with pytest.raises(ValueError, match="penalties needs the texts"):
        chain_loss(_Head(torch.randn(7, 3)), torch.randn(1, 1, 4, 3), torch.zeros(1, 1, 4, dtype=torch.long), (1.0,),
                   objective=Objective("kl", Serving(temperature=0.7, presence_penalty=1.0)), base_hidden=torch.randn(1, 5, 3))


def test_a_step_split_unevenly_over_processes_has_the_one_process_gradient():
    """Rows split 2 + 1 (and 3 + 0, the idle process scoring nothing), each part's loss taken with the step's
    share (`loss.Share`): the mean of the parts' gradients, what DDP applies, is the whole batch's gradient."""
    from occamy_mtp.model.loss import Share

    torch.manual_seed(3)
    vocab, dim, steps = 13, 6, 2
    head = _Head(torch.randn(vocab, dim))
    hidden = torch.randn(steps, 3, 7, dim)
    labels = torch.randint(0, vocab, (steps, 3, 7))
    labels[:, 0, :4] = IGNORE  # the rows score unequal numbers of pairs
    labels[:, 2, :1] = IGNORE
    labels[1, :, -1] = IGNORE
    weights = (0.7, 0.3)
    whole = hidden.clone().requires_grad_(True)
    loss, _ = chain_loss(head, whole, labels, weights, chunk_tokens=5)
    want, = torch.autograd.grad(loss, whole)
    scored = tuple(int((labels[k] != IGNORE).sum()) for k in range(steps))
    for parts in ([[0, 2], [1]], [[0, 1, 2], []]):
        got = torch.zeros_like(hidden)
        losses = []
        for rows in parts:
            part = hidden[:, rows].clone().requires_grad_(True)
            if not rows:  # the idle process: a window with nothing scored
                part = hidden[:, :1].clone().requires_grad_(True)
            part_labels = labels[:, rows] if rows else torch.full_like(labels[:, :1], IGNORE)
            part_loss, _ = chain_loss(head, part, part_labels, weights, chunk_tokens=5, share=Share(scored, len(parts)))
            grad, = torch.autograd.grad(part_loss, part)
            losses.append(float(part_loss.detach()))
            if rows:
                got[:, rows] += grad / len(parts)
        assert_close(got, want, rounding_bound(want, torch.float32, reductions=3, width=vocab), "mean of the parts' gradients")
        assert sum(losses) / len(parts) == pytest.approx(float(loss), rel=1e-6)  # the logged loss: the step's mean
    # without the share, each part's own mean: the 2 + 1 split's mean gradient is not the whole batch's
    parts = [hidden[:, [0, 2]].clone().requires_grad_(True), hidden[:, [1]].clone().requires_grad_(True)]
    grads = [torch.autograd.grad(chain_loss(head, part, labels[:, rows], weights, chunk_tokens=5)[0], part)[0]
             for part, rows in zip(parts, ([0, 2], [1]))]
    plain = torch.zeros_like(hidden)
    plain[:, [0, 2]], plain[:, [1]] = grads[0] / 2, grads[1] / 2
    assert float((plain - want).abs().max()) > 1e-3


def test_a_process_left_without_windows_takes_one_with_nothing_scored():
    from occamy_mtp.data.windows import Window
    from occamy_mtp.model.loss import chain_batch, collate
    from occamy_mtp.train.loop import process_share

    windows = [Window("a", 0, (1, 2, 3, 4), 2), Window("b", 0, (5, 6, 7), 1), Window("c", 0, (8, 9, 10, 11), 3)]
    assert process_share(windows, 0, 2) == [windows[0], windows[2]] and process_share(windows, 1, 2) == [windows[1]]
    idle = process_share(windows[:1], 1, 2)
    assert len(idle) == 1 and idle[0].input_ids == windows[0].input_ids
    batch = collate(idle, torch.device("cpu"))
    chain = chain_batch(batch.input_ids, batch.input_ids, batch.assistant, batch.lengths, 3)
    assert bool((chain.labels == IGNORE).all())
