"""What trains the device side (docs/architecture.md §10): the interval head's and the projector's losses
(`losses`) and the threshold calibration on val prompts (`calibration`); the pipelines in `pipelines/` run them.
"""
