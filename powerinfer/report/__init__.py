"""The power-law report: how skewed each layer's FFN activations are, and how well the predictors track them.

PowerInfer's hot/cold split pays because activation frequency falls off like a power
law with neuron rank: a few hot neurons fire on most tokens, most neurons rarely.
:mod:`powerinfer.report.plot` draws that per layer from an activation folder (frequency
against rank on log-log axes, with the fitted line), the coverage curve (share of all
activations carried by the hottest x% of neurons) and, given a predictor folder, the
predicted against the truly active share per layer; :mod:`powerinfer.report.cli` is
``pi-report``. ``pi-profile`` writes the same picture as ``report.png`` beside its counts.
"""
