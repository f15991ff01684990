"""The reproduction protocol (issue 12): tune DiffSpec over a declared grid, pick the fastest
configuration per dataset and context, then run Auto against the arms on paired prompts and
report decode-only and end-to-end speed separately, with exactness verdicts that name near-ties.

    python -m bench.reproduce --preset smoke|full|custom [flags]

Module map: ``presets`` (what each preset runs), ``cli`` (flags -> ``ProtocolConfig``),
``prompts`` (data files -> prompts cut to a context), ``arms`` (the configurations compared),
``runs`` (one generation through the engine's public API), ``draft_steps`` (each drafting step's tree
and accepted path, recorded between the engine loop and its draft), ``reference`` (``transformers``
``generate``, the outside anchor), ``tuning`` (the grid search), ``exactness`` (divergence verdicts)
with ``replay`` (the fp32 evidence), ``report`` (summaries, markdown), ``plots``, ``protocol`` (the
whole run), ``profiling`` (Nsight), ``inflate`` (8B pair).
"""
