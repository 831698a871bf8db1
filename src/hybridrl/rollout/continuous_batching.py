"""Continuous batching over a fixed set of KV-cache slots, for the lean decode path.

Requests wait in order; up to `max_num_seqs` of them hold a slot. When a row stops (a stop token,
which is kept, or max_new_tokens), the next waiting request is prefilled into its slot; when nothing
waits, the highest slots move down into the holes, so the active rows are always slots 0..n-1 and a
decode step runs on exactly n rows (on CUDA, a graph of the next bucket size, the spare slots
parked on a scratch output row). Outputs are written by request id, so they come back in request
order whatever slot a request used. Sampling noise is keyed by (request seed, token index), never by
the slot or the step, so the tokens of a request do not depend on the batch around it.

Device state lives in buffers allocated once per call and updated only in place (CUDA graphs read
them by address); the host keeps a mirror of what it needs to schedule (request, position, count).

With `record_routes` (MoE models), the expert ids each MoE layer chose are written per request and
sequence position (prompt tokens from prefill, response tokens when decoding feeds them). A row's last
token is never fed by decoding, so a stopped row stays one more decode step, its sample dropped into
the scratch row, and frees its slot after: one extra row-step per request, no extra forward.
"""
from __future__ import annotations

from collections import deque

import torch

from hybridrl.rollout.base import SamplingParams, row_keys, sample_next
from hybridrl.rollout.cuda_graphs import DecodeGraphs
from hybridrl.rollout.lean_decode import DecodeCache, LeanGPT

PREFILL_TOKENS = 16384
"""Prompt tokens (padding included) per prefill forward: bounds the activations of a large refill."""


class SlotBatch:
    """One generate call: rows (prompt, seed) -> tokens and log-probs [R, max_new_tokens] by request."""

    def __init__(self, lean: LeanGPT, rows: list, sampling: SamplingParams, stops: set, pad_id: int,
                 max_num_seqs: int, graphs: str = "off", between_steps=None, record_routes: bool = False):
        """graphs: "off" (eager, attention over the live key range), "capture" (CUDA graphs per
        bucket) or "padded" (the graph path's bucket padding, run eagerly: the CPU check of it).
        between_steps: called after every decode step; True means it replaced the weights in place
        (partial rollout), and rows admitted from then on count one more weight epoch (`row_epoch`).
        record_routes: fill `routes` (MoE models only)."""
        self.lean, self.sampling, self.stops, self.pad_id = lean, sampling, stops, pad_id
        self.prompts = [p for p, _ in rows]
        r, self.new = len(rows), sampling.max_new_tokens
        self.slots = min(max_num_seqs, r)
        self.cache = DecodeCache(lean, self.slots, max(map(len, self.prompts)) + self.new)
        dev = lean.device
        self.keys = row_keys([seed for _, seed in rows], dev)
        zeros = lambda: torch.zeros(self.slots, dtype=torch.long, device=dev)  # noqa: E731
        # per-slot device state; a free slot points at the scratch output row r, position 0
        self.tok, self.pos, self.count, self.key = zeros(), zeros(), zeros(), zeros()
        self.req = torch.full((self.slots,), r, dtype=torch.long, device=dev)
        self.route_req = torch.full((self.slots,), r, dtype=torch.long, device=dev)
        """The request whose routes a slot records: `req`, except one step longer for a stopped row."""
        self.out_tok = torch.full((r + 1, self.new), pad_id, dtype=torch.long, device=dev)
        self.out_logp = torch.zeros(r + 1, self.new, dtype=torch.float32, device=dev)
        # host mirror of slots 0..n-1; a stopped slot holds request -1 until it is refilled or compacted
        self.slot_req, self.slot_pos, self.slot_count = [-1] * self.slots, [0] * self.slots, [0] * self.slots
        self.slot_final = [False] * self.slots  # stopped; in the batch one more step for its last token's route
        self.n, self.lengths, self.waiting = 0, [0] * r, deque(range(r))
        self.stats = {"rollout/forward_tokens": 0, "rollout/generated_tokens": 0}
        self.between_steps, self.epoch, self.row_epoch = between_steps, 0, [0] * r
        """Weight updates taken in so far; per request, those taken in before it was admitted."""
        self.graphs = None if graphs == "off" else DecodeGraphs(self._step, self.slots, capture=graphs == "capture")
        self.routes = None
        """int16 [R + 1, longest prompt + new, moe_layers, topk]: request r's expert ids at sequence position
        q (prompt token q, then response token q - len(prompt)); arange(topk) where nothing was fed."""
        if record_routes and lean.moe_layers:
            pad = torch.arange(lean.topk, dtype=torch.int16, device=dev)
            self.routes = pad.expand(r + 1, self.cache.length, lean.moe_layers, lean.topk).clone()

    # ---- the loop ------------------------------------------------------------------------------------

    @torch.no_grad()
    def run(self):
        """(responses [R, new] pad-filled, response_mask [R, new], log_probs [R, new]), request order."""
        holes: list[int] = []
        while True:
            holes = self._fill(holes)
            self._compact(holes)
            if self.n == 0:
                break
            holes = self._release(self._decode())
            if self.between_steps is not None and self.between_steps():
                self.epoch += 1
        lengths = torch.tensor(self.lengths, device=self.out_tok.device)
        mask = (torch.arange(self.new, device=lengths.device)[None] < lengths[:, None]).float()
        r = len(self.lengths)
        self.stats["rollout/generated_tokens"] = sum(self.lengths)
        return self.out_tok[:r], mask, self.out_logp[:r]

    def _step(self, b: int, length: int | None = None, masked: bool = True):
        """Decode slots [0, b) against keys [0, length) (all of them when None), sample, record."""
        length = self.cache.length if length is None else length
        routes = None if self.routes is None else []
        logits = self.lean.decode(self.cache, self.tok[:b], self.pos[:b], length, masked, routes)
        if routes is not None:  # each slot's fed token sits at its position
            self.routes.index_put_((self.route_req[:b], self.pos[:b]), torch.stack(routes, 1).to(torch.int16))
        tok, logp = sample_next(logits, self.sampling, self.key[:b], self.count[:b])
        index = (self.req[:b], self.count[:b])
        self.out_tok.index_put_(index, tok)
        self.out_logp.index_put_(index, logp)
        return tok, logp

    def _decode(self) -> list[int]:
        """One decode step of the n active slots; the slots that stopped."""
        n = self.n
        if self.graphs is None:  # eager: only the live key range, unmasked when the rows are aligned
            first, last = min(self.slot_pos[:n]), max(self.slot_pos[:n])
            tok, _ = self._step(n, last + 1, masked=first != last)
        else:
            tok, _ = self.graphs(n)
        self.stats["rollout/forward_tokens"] += n
        tok = tok[:n]
        host = tok.tolist()  # the one host sync of a step: the scheduler needs the tokens
        self.tok[:n].copy_(tok)
        self.pos[:n] += 1
        self.count[:n] += 1
        done, stopped = [], []
        for s, t in enumerate(host):
            self.slot_pos[s] += 1
            self.slot_count[s] += 1
            if self.slot_final[s]:
                done.append(s)
            elif t in self.stops or self.slot_count[s] == self.new:
                stopped.append(s)
        return done + self._stopped(stopped)

    # ---- slots: refill, release, compaction ---------------------------------------------------------

    def _stopped(self, slots: list[int]) -> list[int]:
        """Rows that sampled their last token: their lengths are known; the slots to free now (recording
        routes: none, each stays one more step to feed its last token, its sample going to scratch)."""
        for s in slots:
            self.lengths[self.slot_req[s]] = self.slot_count[s]
        if self.routes is None or not slots:
            return slots
        idx = torch.tensor(slots, device=self.tok.device)
        self.req[idx], self.count[idx] = len(self.lengths), 0
        for s in slots:
            self.slot_final[s] = True
        return []

    def _release(self, slots: list[int]) -> list[int]:
        for s in slots:
            self.slot_req[s], self.slot_final[s] = -1, False
        return sorted(slots)

    def _fill(self, holes: list[int]) -> list[int]:
        """Prefill waiting requests into the holes, then into unused slots; the holes still empty."""
        while self.waiting:
            free = holes + list(range(self.n, self.slots))
            targets = free[:len(self.waiting)]
            if not targets:
                break
            reqs = [self.waiting.popleft() for _ in targets]
            self.n = max(self.n, targets[-1] + 1)  # free is ascending: holes, then unused slots
            holes = sorted(holes[len(targets):] + self._release(self._admit(targets, reqs)))
        return holes

    def _admit(self, targets: list[int], reqs: list[int]) -> list[int]:
        """Prefill reqs into slots targets (chunks of PREFILL_TOKENS); the slots whose first token stops."""
        done, dev = [], self.tok.device
        chunk = max(1, PREFILL_TOKENS // max(len(self.prompts[r]) for r in reqs))
        for start in range(0, len(reqs), chunk):
            slots, ids = targets[start:start + chunk], reqs[start:start + chunk]
            plens = [len(self.prompts[r]) for r in ids]
            tokens = torch.full((len(ids), max(plens)), self.pad_id, dtype=torch.long)
            for i, r in enumerate(ids):
                tokens[i, :plens[i]] = torch.tensor(self.prompts[r])
            slot_t, req_t = torch.tensor(slots, device=dev), torch.tensor(ids, device=dev)
            plen_t = torch.tensor(plens, device=dev)
            routes = None if self.routes is None else []
            logits = self.lean.prefill(self.cache, slot_t, tokens.to(dev), plen_t - 1, routes)
            if routes is not None:
                self._record_prompt_routes(req_t, plen_t, routes)
            self.stats["rollout/forward_tokens"] += tokens.numel()
            keys = self.keys[req_t]
            tok, logp = sample_next(logits, self.sampling, keys, torch.zeros_like(req_t))
            self.out_tok[req_t, 0], self.out_logp[req_t, 0] = tok, logp
            for state, value in ((self.tok, tok), (self.pos, plen_t), (self.count, torch.ones_like(req_t)),
                                 (self.req, req_t), (self.route_req, req_t), (self.key, keys)):
                state[slot_t] = value
            for s, r, p, t in zip(slots, ids, plens, tok.tolist()):
                self.slot_req[s], self.slot_pos[s], self.slot_count[s] = r, p, 1
                self.row_epoch[r] = self.epoch
                if t in self.stops or self.new == 1:
                    done.append(s)
        return self._stopped(done)

    def _record_prompt_routes(self, req_t: torch.Tensor, plen_t: torch.Tensor, routes: list) -> None:
        """Prefill's expert ids [k * P, topk] per MoE layer into the prompt positions of requests req_t."""
        k = req_t.shape[0]
        got = torch.stack(routes, 1).view(k, -1, self.lean.moe_layers, self.lean.topk).to(torch.int16)
        width = got.shape[1]
        pad = torch.arange(width, device=got.device)[None] >= plen_t[:, None]  # right padding of the chunk
        blank = torch.arange(self.lean.topk, dtype=torch.int16, device=got.device)
        self.routes[req_t, :width] = torch.where(pad[..., None, None], blank, got)

    def _compact(self, holes: list[int]) -> None:
        """Move the highest active slots into the holes, so slots 0..n-1 are active; park the rest."""
        if not holes:
            return
        top = self.n - len(holes)
        dst = [h for h in holes if h < top]
        src = [s for s in range(top, self.n) if self.slot_req[s] >= 0]
        if dst:
            d, s = torch.tensor(dst, device=self.tok.device), torch.tensor(src, device=self.tok.device)
            for state in (self.tok, self.pos, self.count, self.req, self.route_req, self.key):
                state[d] = state[s]
            used = max(self.slot_pos[i] for i in src)  # keys [0, pos) are written; the rest is free
            self.cache.kv[:, :, d, :, :used] = self.cache.kv[:, :, s, :, :used]
            for a, b in zip(dst, src):
                self.slot_req[a], self.slot_pos[a], self.slot_count[a], self.slot_final[a] = (
                    self.slot_req[b], self.slot_pos[b], self.slot_count[b], self.slot_final[b])
        for state, value in ((self.tok, self.pad_id), (self.pos, 0), (self.count, 0), (self.key, 0),
                             (self.req, len(self.lengths)), (self.route_req, len(self.lengths))):
            state[top:self.n] = value
        self.slot_req[top:self.n] = [-1] * (self.n - top)
        self.slot_final[top:self.n] = [False] * (self.n - top)
        self.n = top
