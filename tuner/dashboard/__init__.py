"""The static dashboard: what was tuned, how it has held up since, and why it is fast or slow.

``tune dashboard --db results.db --out site/`` writes plain HTML pages from the Jinja templates
of ``templates/``, with the charts drawn by matplotlib inlined as SVG and one stylesheet copied
from ``tuner/dashboard_assets/``: no script, nothing fetched, so the site opens from disk
(``file://``) and can be archived as a CI artefact. Pages:

- ``index.html``: every problem with its winners, latest verdict (:mod:`tuner.regress`'s rule)
  and a sparkline of its history; our kernels against FLA and the memory-bound floor
  (``benchmarks/vs_fla.json`` from ``benchmarks/vs_fla.py``, "not measured" without it).
- one page per problem (variant, head dims, dtype, timed shape): the latency history of each
  winner across runs with its p10-p90 band, the reference band, stack changes (TileLang, CUDA,
  driver, torch) marked where they happened and regressions marked on the point; the winners'
  configs, registers (ptxas / predicted) and gate errors; tuning convergence (best latency
  against trial number and against cumulative GPU-seconds); which parameters mattered
  (:func:`.data.parameter_effects`, measured from the timed trials without a model).
- ``model.html``: the register model's prediction against ptxas, one scatter per variant.

Modules: :mod:`.data` reads the database into views, :mod:`.charts` draws, :mod:`.site` fills the
templates and writes the folder.
"""
from .site import dashboard_main, write_site

__all__ = ["dashboard_main", "write_site"]
