"""The cost lab, by purpose: ``bench/`` (timed benchmarks), ``calculators/`` (closed-form memory figures),
``figures/`` (teaching plots); shared below them: ``options`` (argument parsing), ``measure`` (timing, peak
memory, tables, saving), ``implementations`` (the registry of what is timed), ``fitting``, ``traffic``,
``units``, ``plots``. Commands import shared modules, never each other."""
