"""A drafter family defined outside eyas, for tests: proof that a family is one module and a registration.

``EYAS_FAMILIES=toy_family`` (with this folder on PYTHONPATH) makes ``eyas train --drafter toy`` train it, ``eyas
export`` write it, ``eyas check`` check it and ``eyas bench`` decode with it — no file under src/ names it.

The toy is a Medusa-like head: from the target's tapped states at the last position the target ran and the embedding of
the token after it (the round's root), one hidden layer, then one linear map per proposal, each read out by the target's
own lm_head: ``--toy-heads`` proposals a round, all from one forward. It is trained against the target's greedy
tokens, so a trained toy is sometimes right; it need not be good, only lossless.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eyas.families import Built, Family, register
from eyas.options import Options, at_least, option

ARCHITECTURE = "EyasToyHead"


class ToyConfig(dict):
    """The toy's shape; ``to_dict`` is what the trainer records of every drafter's config."""

    def to_dict(self) -> dict:
        return dict(self)


@dataclass
class ToyOptions(Options):
    toy_heads: int = option(3, "proposals a round (one head each)", check=at_least(1))


def _modules():
    """The toy's torch parts, built on first use (the family's registration imports no torch)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class ToyHead(nn.Module):
        def __init__(self, config: dict):
            super().__init__()
            self.config = ToyConfig(config)
            hidden, taps = config["hidden_size"], len(config["layer_ids"])
            self.fc = nn.Linear(taps * hidden, hidden)
            self.embed = nn.Embedding(config["vocab_size"], hidden)
            self.heads = nn.Linear(hidden, config["heads"] * hidden)

        def hidden(self, aux: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
            """States ``aux`` [..., taps·H] and the tokens after them ``root`` [...] → each head's hidden [..., K, H]."""
            h = F.silu(self.fc(aux) + self.embed(root))
            return self.heads(h).unflatten(-1, (self.config["heads"], -1))

        def trainable_parameters(self):
            return list(self.parameters())

    class ToyRunner:
        """The engine's side: a cache of the target's tapped states by position; a round's proposals come from the
        state just before the root's position, in one forward, on the device (no host read)."""

        blocks = True  # proposes a whole chain in one forward, as a block drafter does

        def __init__(self, drafter: ToyHead, lm_head: nn.Module, capacity: int):
            self.drafter, self.lm_head, self.capacity = drafter, lm_head, capacity
            param = drafter.fc.weight
            self.device, self.dtype = param.device, param.dtype
            self.cache = torch.zeros(capacity, param.shape[1], dtype=self.dtype, device=self.device)
            self.slots = torch.arange(capacity, device=self.device)
            self.length = 0

        @property
        def layer_ids(self):
            return tuple(self.drafter.config["layer_ids"])

        def reset(self) -> None:
            self.length = 0

        @torch.no_grad()
        def commit_prompt(self, aux, next_tokens, positions) -> None:
            self.commit(aux, positions)
            self.length += aux.shape[1]

        def commit(self, aux, positions) -> None:
            places = positions[0, :1].to(self.device) + self.slots[: aux.shape[1]]
            self.cache.index_copy_(0, places, aux[0].to(self.device, self.dtype))

        def slot_logits(self, root, anchor, steps: int):
            state = self.cache.index_select(0, (anchor - 1).view(1).to(self.device))
            return self.lm_head(self.drafter.hidden(state, root.view(1).to(self.device))[0, :steps])

        def propose(self, root, anchor, steps: int):
            return self.slot_logits(root, anchor, steps).argmax(-1)

    return torch, F, ToyHead, ToyRunner


def _heads_logits(torch, drafter, batch, head):
    """Each head's logits at each context position t (predicting position t + 1 + k) and the greedy labels there:
    [(logits [R, T − 1 − k, V], labels, trained mask)] for k = 1 … K."""
    aux, ids, final, mask = batch.aux, batch.input_ids, batch.final, batch.loss_mask
    width = ids.shape[1]
    with torch.no_grad():  # the target's greedy token at each position p: argmax of its final state at p − 1
        greedy = (final[:, :-1].to(head.dtype) @ head.T).argmax(-1)  # [R, T − 1]: position p = index + 1
    hidden = drafter.hidden(aux[:, :-1], ids[:, 1:])  # context t, root = the token at t + 1
    out = []
    for k in range(1, drafter.config["heads"] + 1):
        n = width - 1 - k
        if n <= 0:
            break
        logits = hidden[:, :n, k - 1].to(head.dtype) @ head.T
        out.append((logits.float(), greedy[:, k : k + n], mask[:, 1 + k : 1 + k + n] > 0))
    return out


class Toy(Family):
    name = "toy"
    summary = "a test-only Medusa-like head"
    options = ToyOptions
    formats = {"toy": "the toy's own directory"}

    def build(self, inputs):
        torch, _, ToyHead, _ = _modules()
        torch.manual_seed(inputs.options.seed)
        config = {"hidden_size": int(inputs.head.shape[1]), "vocab_size": int(inputs.head.shape[0]),
                  "layer_ids": list(inputs.layer_ids), "heads": inputs.options.toy_heads}
        return Built(ToyHead(config).to(inputs.device))

    def tally_weights(self, options, drafter):
        return [1.0] * drafter.config["heads"]

    def micro_batch(self, setup, batch, options, weights, autocast, tallies, seed):
        torch, F, _, _ = _modules()
        losses, correct, counted = tallies
        total = 0.0
        with autocast():
            for k, (logits, labels, mask) in enumerate(_heads_logits(torch, setup.drafter, batch, setup.head)):
                loss = (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none") * mask.flatten()).sum() \
                    / mask.sum().clamp(min=1)
                total = total + weights[k] * loss
                losses[k] += loss.detach() / options.grad_accum
                correct[k] += ((logits.argmax(-1) == labels) & mask).sum()
                counted[k] += mask.sum()
        (total / options.grad_accum).backward()
        return batch.tokens

    def evaluate(self, setup, options, weights, autocast):
        torch, F, _, _ = _modules()
        heads = setup.drafter.config["heads"]
        accepted, positions, loss, hits, counts = torch.zeros(heads), 0, 0.0, torch.zeros(heads), torch.zeros(heads)
        batches = range(min(options.eval_batches or len(setup.holdout.batches), len(setup.holdout.batches)))
        with torch.no_grad(), autocast():
            for b in batches:
                run = None
                for k, (logits, labels, mask) in enumerate(_heads_logits(torch, setup.drafter, setup.holdout.batch(b),
                                                                         setup.head)):
                    right = (logits.argmax(-1) == labels) & mask
                    run = right if run is None else run[:, : right.shape[1]] & right  # all heads up to k right
                    if k == 0:
                        positions += int(mask.sum())
                    accepted[k] += float(run.sum())
                    hits[k] += float(right.sum())
                    counts[k] += float(mask.sum())
                    loss += weights[k] * float(F.cross_entropy(logits[mask], labels[mask])) if mask.any() else 0.0
        cumulative = (accepted / max(positions, 1)).tolist()
        return {"loss": loss / max(len(batches), 1), "accuracy": (hits / counts.clamp(min=1)).tolist(),
                "acceptance_cumulative": cumulative, "tau": 1.0 + sum(cumulative),
                "tau_meaning": f"a chain of {heads} heads from each holdout position"}

    def exported(self, config):
        return ARCHITECTURE in config.get("architectures", [])

    def export(self, recorded, weights, fmt, dtype, train_options, report, target, out):
        from eyas.export.files import TORCH_DTYPES

        config = {"architectures": [ARCHITECTURE], "hidden_size": recorded["hidden_size"],
                  "vocab_size": recorded["vocab_size"], "eagle_aux_hidden_state_layer_ids": recorded["layer_ids"],
                  "toy_heads": recorded["heads"]}
        tensors = {name: t.to(TORCH_DTYPES[dtype]).contiguous() for name, t in weights.items()}
        return config, tensors, f"# {Path(out).name}: a toy head ({recorded['heads']} proposals a round)\n"

    def check(self, directory, config, target, result):
        from eyas.export.files import integrity_problems, read_shapes

        result.errors.extend(integrity_problems(directory))
        names = set(read_shapes(directory, normalise=False)) if not result.errors else set()
        missing = {"fc.weight", "embed.weight", "heads.weight"} - names
        if not result.errors and missing:
            result.errors.append(f"tensors missing: {sorted(missing)}")
        if not isinstance(config.get("toy_heads"), int):
            result.errors.append("config.json: toy_heads is missing")

    def runner(self, draft_dir, layout, capacity, modes):
        from safetensors.torch import load_file

        from eyas.engine.modes import drafter_spare
        from eyas.errors import EyasError
        from eyas.export.files import read_draft_config

        _, _, ToyHead, ToyRunner = _modules()
        config = read_draft_config(draft_dir)
        heads = config["toy_heads"]
        for mode in modes:
            if mode.mode != "chain" or mode.draft_length > heads:
                raise EyasError(f"--mode {mode.label()}: a toy head proposes one chain of up to {heads} tokens")
        weight = layout.embed.weight
        drafter = ToyHead({"hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"],
                           "layer_ids": config["eagle_aux_hidden_state_layer_ids"], "heads": heads})
        drafter.load_state_dict(load_file(str(Path(draft_dir) / "model.safetensors")))
        drafter = drafter.to(weight.device, weight.dtype).eval()
        return ToyRunner(drafter, layout.lm_head, capacity + drafter_spare(modes))

    def default_modes(self, config):
        from eyas.speculation import Chain

        return [Chain(int(config["toy_heads"]))]


TOY = register(Toy())
