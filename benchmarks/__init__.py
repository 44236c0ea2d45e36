"""tokenyard's benchmarks: ``python -m benchmarks {mailbox,all,plot} [--json PATH]``.

Each suite runs every variant in fresh processes, measures its baselines in the same
invocation and reports ratios against them, the machine and the library versions (the
layout of msgspec's benchmark page). ``python -m benchmarks plot results.json --out DIR``
draws the charts.
"""
