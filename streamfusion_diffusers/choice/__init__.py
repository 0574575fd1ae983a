"""The layout choice: which layout for this attention shape on this cluster.

Above the core (it reads layouts and meshes, never the reverse), below the integrations. It owns the workload
shapes (workloads.py), the cost model (costmodel.py), the measured rules that overrule it (rules.py), the
recipe files and their loader and writer (recipe.py, store.py, recipes/), the calibration of the cost model
(calibrate.py, predictions.py, regenerate.py) and `method="auto"` (choose.py), which the core is handed as
its layout chooser by `init_parallel`.
"""
