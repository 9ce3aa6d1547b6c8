"""The device's time for one step's subgroups: those in device memory updated in place, and host-held
ones copied through it and back. The step loop spreads the first between the second
(``step.loop.interleaved``), so on a GPU the compute stream updates both kinds while the host link
copies the streamed ones: the longer of the two is the time. One after the other (the CPU twin, whose
"streams" run in order; a deferred step, queued in the next forward's order) the two add up."""

from __future__ import annotations

from typing import Optional


def device_share_seconds(hbm_elems: float, streamed_elems: float, resident_rate: Optional[float],
                         streamed_rate: Optional[float], interleaved: bool = True) -> float:
    """Seconds for ``hbm_elems`` updated in device memory at ``resident_rate`` and ``streamed_elems``
    streamed at ``streamed_rate`` (elements/s; the link-bound rate of copy in, update, copy out).
    Interleaved, the streamed ones' own updates run on the compute stream at the resident rate too."""
    hbm_s = hbm_elems / resident_rate if hbm_elems and resident_rate else 0.0
    link_s = streamed_elems / streamed_rate if streamed_elems and streamed_rate else 0.0
    if not (interleaved and hbm_s and link_s):
        return hbm_s + link_s
    return max(link_s, hbm_s + streamed_elems / resident_rate)


def streamed_seconds_within(device_s: float, hbm_elems: float, streamed_elems: float,
                            resident_rate: Optional[float], interleaved: bool = True) -> Optional[float]:
    """The streamed subgroups' link time a measured ``device_s`` shows (the inverse of
    ``device_share_seconds``), or None where it shows none: interleaved and no longer than the compute
    stream's own work, the link was not what bound the step."""
    if not (hbm_elems and resident_rate):
        return device_s if device_s > 0 else None
    if not interleaved:
        rest = device_s - hbm_elems / resident_rate
        return rest if rest > 0 else None
    compute_s = (hbm_elems + streamed_elems) / resident_rate
    return device_s if device_s > compute_s else None
