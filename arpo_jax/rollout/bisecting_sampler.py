"""Engine-failure isolation as a `Sampler` wrapper: a batched call that raises is retried on halves of its requests.

The agent loop wraps its engine in `BisectingSampler` when `RolloutConfig.isolate_failures` is set (config
`rollout.failures.isolate`); a request whose result is None then ends its trajectory as `engine_error`. Without
the wrapper an engine error propagates, as in the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from arpo_jax.rollout.sampler import Sampler, SampleRequest, SampleResult, SamplingSettings, generate_each

log = logging.getLogger(__name__)


class BisectingSampler(Sampler):
    """Wraps an engine so that only a request that raises *on its own* fails.

    A `generate` call that raises is retried on each half of its requests, recursively (about 2 log2(n) calls for one
    bad request among n, the healthy halves still batched); a single request that still raises gets None in place of
    its result. So `generate` returns `list[SampleResult | None]`, one entry per request, in order.
    """

    def __init__(self, inner: Sampler):
        self.inner = inner

    @property
    def reports_each(self) -> bool:
        return getattr(self.inner, "reports_each", False)

    @property
    def last_stats(self) -> dict:
        return getattr(self.inner, "last_stats", None) or {}

    def generate(self, requests: Sequence[SampleRequest], settings: SamplingSettings,
                 on_result: Callable[[int, SampleResult | None], None] | None = None) -> list[SampleResult | None]:
        """With `on_result`, each result as the engine reports it; after a failure, the retries' results of the
        requests not reported yet (a reported one keeps the result it was reported with)."""
        reported: dict[int, SampleResult | None] = {}

        def report(i: int, res: SampleResult | None) -> None:
            reported[i] = res
            if on_result is not None:
                try:
                    on_result(i, res)
                except Exception as e:  # the caller's error, not the engine's: no retry
                    raise _CallerError() from e

        try:
            return generate_each(self.inner, requests, settings, report)
        except _CallerError as e:
            raise e.__cause__ from None
        except Exception as e:
            log.warning("engine call of %d requests raised %s: %s; retrying its halves", len(requests),
                        type(e).__name__, e)
            results = self._halves(requests, settings)
            self.inner.reset_cache()  # nothing the retries cached may leak into the next call
        for i, res in enumerate(results):
            if i in reported:
                results[i] = reported[i]
            elif on_result is not None:
                on_result(i, res)
        return results

    def _halves(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[SampleResult | None]:
        half = len(requests) // 2
        return self._retry(requests[:half], settings) + self._retry(requests[half:], settings)

    def _retry(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[SampleResult | None]:
        if not requests:
            return []
        self.inner.reset_cache()  # a call that raised may have left the engine's cache inconsistent
        try:
            return list(self.inner.generate(requests, settings))
        except Exception as e:
            if len(requests) == 1:
                log.warning("engine request of slot %s raised %s: %s; its result is None (its trajectory fails)",
                            requests[0].slot_id, type(e).__name__, e)
                return [None]
            return self._halves(requests, settings)

    def update_weights(self, params_or_path) -> float:
        return self.inner.update_weights(params_or_path)

    def reset_cache(self) -> None:
        self.inner.reset_cache()

    def sleep(self) -> None:
        self.inner.sleep()

    def close(self) -> None:
        self.inner.close()


class _CallerError(Exception):
    """An exception raised by the caller's `on_result` (its cause), carried through the engine."""
