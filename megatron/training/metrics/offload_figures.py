"""The offload engine's figures in the metrics record: per iteration as named scalars (TensorBoard,
W&B), and per log interval as ``key: value`` pairs for the console line.

Figures come from the engine's ``StepRecord`` (mlp_offload): the update's time and its
prediction, the read wait, bytes and busy time per file tier, token waits, cache hits; plus the
state bytes each tier holds.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from mlp_offload import GB, StepRecord, TierTraffic, first_forward_share, predict_iteration


def step_scalars(record: StepRecord, state_bytes: Optional[Dict[str, int]] = None) -> Dict[str, float]:
    """One optimizer step's figures, named for TensorBoard/W&B (seconds, bytes, GB/s)."""
    scalars = {}
    if not record.skipped:
        scalars.update({
            "offload/update-time": record.update_s,
            "offload/update-time-predicted": record.predicted_update_s,
            "offload/adam-time": record.adam_s,
            "offload/grad-convert-time": record.convert_s,
            "offload/read-wait-time": record.read_wait_s,
            "offload/deferred-device-update-time": record.deferred_device_s,
            "offload/forward-wait-time": record.forward_wait_s,
            "offload/cache-hits": record.cache_hits,
            "offload/streamed-subgroups": record.streamed,
        })
    for tier, traffic in record.tiers.items():
        scalars.update({
            f"offload/{tier}-read-bytes": traffic.read_bytes,
            f"offload/{tier}-read-GBps": traffic.read_gbps,
            f"offload/{tier}-write-bytes": traffic.write_bytes,
            f"offload/{tier}-write-GBps": traffic.write_gbps,
            f"offload/{tier}-token-wait-time": traffic.token_wait_s,
        })
    for tier, nbytes in (state_bytes or {}).items():
        scalars[f"offload/{tier}-state-bytes"] = nbytes
    return scalars


class IterationModel:
    """The iteration predicted beside the measured one: the compute alone, measured in an iteration
    that ran without the update beside it (its update in series, or after a settled step: the
    overlap's first steps), with the engine's update prediction (``predict_iteration``)."""

    def __init__(self, micro_batches: int, recompute_full: bool):
        self.first_forward_share = first_forward_share(micro_batches, recompute_full)
        self.compute_s: Optional[float] = None
        self._ran_alone = False  # the previous step left nothing of its update under this iteration

    def observe(self, elapsed_s: float, record: StepRecord, first_of_run: bool) -> Optional[float]:
        """This iteration's prediction (None until a compute time is known); learns from it."""
        if record.skipped:
            return None
        predicted = None
        if self.compute_s is not None:
            predicted = predict_iteration(self.compute_s, record.predicted_update_s, record.predicted_deferred_s,
                                          record.predicted_serial_s, self.compute_s * self.first_forward_share,
                                          record.predicted_deferred_in_hbm_s)
        if self._ran_alone and not first_of_run:
            self.compute_s = max(0.0, elapsed_s - record.update_s)
        self._ran_alone = record.settled or not record.predicted_deferred_s
        return predicted


class OffloadInterval:
    """The steps of one log interval, summed for the console line."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.updates = 0
        self.update_s = self.predicted_s = self.adam_s = self.read_wait_s = self.deferred_s = 0.0
        self.deferred = 0
        self.forward_wait_s = 0.0
        self.read_ahead = 0  # subgroups whose state was copied in before their step
        self.iteration_s = self.predicted_iteration_s = 0.0  # over the iterations with a prediction
        self.predicted_iterations = 0
        self.cache_hits = self.streamed = 0
        self.tiers: Dict[str, TierTraffic] = {}

    def add_prediction(self, elapsed_s: float, predicted_s: Optional[float]) -> None:
        if predicted_s is not None:
            self.predicted_iterations += 1
            self.iteration_s += elapsed_s
            self.predicted_iteration_s += predicted_s

    def add(self, record: StepRecord) -> None:
        if not record.skipped:  # a skipped step moved nothing of its own, but I/O it overlapped did
            self.updates += 1
            self.update_s += record.update_s
            self.predicted_s += record.predicted_update_s
            self.adam_s += record.adam_s
            self.read_wait_s += record.read_wait_s
            if record.deferred_device_s:
                self.deferred += 1
                self.deferred_s += record.deferred_device_s
            self.forward_wait_s += record.forward_wait_s
            self.read_ahead += record.read_ahead
            self.cache_hits += record.cache_hits
            self.streamed += record.streamed
        for name, t in record.tiers.items():
            total = self.tiers.setdefault(name, TierTraffic())
            total.read_bytes += t.read_bytes
            total.write_bytes += t.write_bytes
            total.read_busy_s += t.read_busy_s
            total.write_busy_s += t.write_busy_s
            total.token_wait_s += t.token_wait_s

    def console_pairs(self, iterations: int) -> List[Tuple[str, str]]:
        """Per-iteration averages over the interval; rates from the interval's bytes and busy time."""
        if not self.updates and not self.tiers:
            return []
        per_update = max(self.updates, 1)
        per_iteration = max(iterations, 1)
        pairs = [
            ("offload update time (ms)", f"{self.update_s / per_update * 1000:.1f}"),
            ("offload predicted update time (ms)", f"{self.predicted_s / per_update * 1000:.1f}"),
            ("offload adam time (ms)", f"{self.adam_s / per_update * 1000:.1f}"),
            ("offload read wait (ms)", f"{self.read_wait_s / per_update * 1000:.1f}"),
        ]
        if self.deferred:  # --offload-overlap-forward: update time is the host's share; the device's here
            pairs.append(("offload device update time (ms)", f"{self.deferred_s / self.deferred * 1000:.1f}"))
            pairs.append(("offload forward wait (ms)", f"{self.forward_wait_s / per_update * 1000:.1f}"))
        if self.read_ahead:
            pairs.append(("offload subgroups read ahead", f"{self.read_ahead / per_update:.1f}"))
        if self.predicted_iterations:
            pairs.append(("offload predicted iteration time (ms)",
                          f"{self.predicted_iteration_s / self.predicted_iterations * 1000:.1f}"))
        for name, t in self.tiers.items():
            pairs += [
                (f"offload {name} read (GB)", f"{t.read_bytes / per_iteration / GB:.3f}"),
                (f"offload {name} read (GB/s)", f"{t.read_gbps:.2f}"),
                (f"offload {name} write (GB)", f"{t.write_bytes / per_iteration / GB:.3f}"),
                (f"offload {name} write (GB/s)", f"{t.write_gbps:.2f}"),
                (f"offload {name} token wait (ms)", f"{t.token_wait_s / per_iteration * 1000:.1f}"),
            ]
        if self.streamed:
            pairs.append(("offload cache hits", f"{self.cache_hits}/{self.streamed}"))
        return pairs
