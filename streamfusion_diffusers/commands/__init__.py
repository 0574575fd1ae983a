"""The commands (`streamfusion generate | verify | launch | plan | tune | bench`) and what only they use:
spawning local ranks, phase and layer timing. The top floor: only here is bench/ imported.
"""
