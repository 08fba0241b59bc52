"""`data=hf`: this rank's batches from a Hugging Face dataset, tokenized and packed as training reads them.

TokenBatches' interface (data.py) over data/hf_stream.py's PackedStream: step s takes this rank's next grad_accum x
micro_batch windows of its own share of the split (datasets' split_dataset_by_node), in order. Unlike the
random windows of a token file, the position is not a function of the step: it is state, saved in each rank's
part of the checkpoint (`state_dict`) and restored from it (`load_state_dict`), so a resumed run reads the windows
the uninterrupted one would have read. The samples count (`first_sample`) follows the same ramp as TokenBatches'.
Chat and instruction rows carry loss-mask flags: a target outside the answers is IGNORE_INDEX, exactly as in the
micro-batches of a prepared chat dataset (data.py's to_inputs_targets), and the step's loss divides by the
counted targets (loss.step_divisor) as it does for those.
"""

from __future__ import annotations

import numpy as np

from trainctl.config.schema import DataConfig
from trainctl.core.batch_ramp import BatchRamp
from trainctl.data import hf_stream
from trainctl.data.format import DatasetError
from trainctl.train.loop.data import MicroBatch, to_inputs_targets
from trainctl.train.loop.sources import DataError


class StreamBatches:
    """Batches of one split of a data=hf dataset for one data-parallel rank (module doc)."""

    masked, document_mask, num_tokens = False, False, None

    def __init__(self, data_cfg: DataConfig, split: str, seq_len: int, global_batch: int, micro_batch: int,
                 grad_accum: int, dp_rank: int, dp_size: int, seed: int, ramp: BatchRamp | None = None):
        assert global_batch == micro_batch * grad_accum * dp_size, (global_batch, micro_batch, grad_accum, dp_size)
        name = data_cfg.split if split == "train" else data_cfg.val_split
        if not name:
            raise DataError("data.val_split: none named, so there is no held-out split to evaluate on")
        self.split, self.seq_len, self.seed, self.micro_batch = split, seq_len, seed, micro_batch
        self.dp_rank, self.dp_size, self.vocab_size = dp_rank, dp_size, data_cfg.vocab_size
        self.ramp = ramp or BatchRamp(micro_batch * dp_size, grad_accum, grad_accum, 0, 0)
        self._base_step = self._base_sample = 0
        self._key = f"data.source={data_cfg.source} ({name})"
        self._eval: list[MicroBatch] | None = None
        key = "data.split" if split == "train" else "data.val_split"
        try:
            documents = hf_stream.Documents(data_cfg, hf_stream.open_tokenizer(data_cfg.tokenizer), self._key)
            fields = hf_stream.record_fields(data_cfg)
            self._stream = hf_stream.PackedStream(
                lambda: hf_stream.open_split(data_cfg.source, name, data_cfg.hf_config, data_cfg.streaming,
                                             fields, dp_rank, dp_size, key),
                documents, seq_len + 1, self._key)
        except DatasetError as exc:
            raise DataError(str(exc)) from None
        # chat and instruction rows: targets outside the answers are IGNORE_INDEX, as prepared chat data's are
        self.masked = documents.masked

    def state_dict(self) -> dict:
        """The stream's position (this rank's): saved with the rank's RNG state in each checkpoint."""
        return self._stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._stream.load_state_dict(state)

    def resume_at(self, step: int, samples_seen: int) -> None:
        """Count samples from `samples_seen` at `step` on (the position itself comes from load_state_dict)."""
        self._base_step, self._base_sample = step, samples_seen

    def first_sample(self, step: int) -> int:
        """Stream index of the first sample of `step`'s global batch (as TokenBatches counts it)."""
        ramp = self.ramp
        return self._base_sample + ramp.sequences_before(step) - ramp.sequences_before(self._base_step)

    def micro_batches(self, step: int) -> list[MicroBatch]:
        """This rank's next grad_accum micro-batches of [micro_batch, seq_len] (inputs, targets)."""
        accum = self.ramp.accum_at(step)
        rows = self._windows(accum * self.micro_batch)
        return [self._pair(rows[a * self.micro_batch:(a + 1) * self.micro_batch]) for a in range(accum)]

    def eval_batches(self, n: int) -> list[MicroBatch]:
        """The first `n` micro-batches of this rank's share of the held-out split: the same ones at every eval."""
        if self._eval is None or len(self._eval) < n:
            rows = self._windows(n * self.micro_batch)
            self._eval = (self._eval or []) + [self._pair(rows[i * self.micro_batch:(i + 1) * self.micro_batch])
                                               for i in range(n)]
        return self._eval[:n]

    def _windows(self, count: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
        try:
            return self._stream.windows(count)
        except DatasetError as exc:
            raise DataError(str(exc)) from None

    def _pair(self, rows: list[tuple[np.ndarray, np.ndarray | None]]) -> MicroBatch:
        samples = np.stack([tokens for tokens, _ in rows])
        if int(samples.max()) >= self.vocab_size:
            raise DataError(f"{self._key}: token id {int(samples.max())} >= data.vocab_size={self.vocab_size}; "
                            "use the model's tokenizer (data.tokenizer) or a larger model.vocab_size")
        flags = np.stack([f for _, f in rows]) if self.masked else None
        return to_inputs_targets(samples, flags)
