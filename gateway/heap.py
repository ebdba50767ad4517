"""How a long-lived process of ours collects its garbage: what lives as long as the process set
aside once it has started (``settle``), and, for the hub, a young generation sized for a server.

A full collection walks every tracked object. The ~40,000 of the imported modules were most of
a runner's (15-20 ms of CPU, 70 ms and more of wall time on a busy machine, paid by every chunk
in flight: bench/profiles/tail-gc.txt); ``settle`` moves them, and all else made before the
process serves, to the permanent generation, which no collection walks.

A hub holding thousands of sessions has hundreds of thousands of objects of its own (about 100
a session), and a full collection of them takes 0.6-0.9 s of CPU at 5,000 sessions, every turn
in flight held meanwhile. CPython collects everything once the objects promoted to the oldest
generation since the last full collection reach a quarter of those in it, and with the default
young threshold (700 allocations) an idle hub promotes a steady stream of short-lived objects
(a poll's, a ping's, caught alive by a collection every few milliseconds): at 1,000 runners and
5,000 sessions one full collection every minute or two, about 2 % of a core and a pause of most
of a second each. With ``HUB_YOUNG`` (a young collection every 10,000 allocations, a fraction
of a millisecond each) those objects die young: one full collection in a whole fleet run, as
``python -m bench.fleet`` counts with ``FLEET_HUB_GC`` (bench/README.md).
"""

from __future__ import annotations

import gc

HUB_YOUNG = 10_000  # allocations between the hub's young collections (CPython's default: 700)


def settle(young: int | None = None) -> None:
    """Collect once, move every object alive to the permanent generation, and with ``young``
    set the young generation's threshold (the older ones' kept)."""
    gc.collect()
    gc.freeze()
    if young is not None:
        _, middle, old = gc.get_threshold()
        gc.set_threshold(young, middle, old)
