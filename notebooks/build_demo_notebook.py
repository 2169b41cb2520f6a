"""Build and execute notebooks/demo_pipeline.ipynb: the four stages on the bundled demo model.

Usage: python notebooks/build_demo_notebook.py   (needs the `notebooks` extra: matplotlib, nbclient)
"""
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell

cells = [
    md("# PowerInfer in Python: the four stages on the demo model\n\n"
       "The bundled demo model is Karpathy's stories260K (a 5-layer Llama trained on TinyStories) made "
       "ReLU-sparse by `recipes/relufy.py`. This notebook runs `pi-profile`, `pi-train-predictor`, "
       "`pi-convert` and `pi-run` on it, and plots what PowerInfer rests on: a power-law of neuron "
       "activation frequency (few hot neurons, many cold ones) and predictors that find the active "
       "neurons with high recall while computing only a small share of them."),
    code("import json, subprocess, time\nfrom pathlib import Path\n\nimport matplotlib.pyplot as plt\n"
         "import numpy as np\n\nimport powerinfer\nfrom powerinfer.formats.activation import load_activation_dir, "
         "load_activation_stats\nfrom powerinfer.formats.predictor import load_predictor_dir, read_predictor_config\n"
         "from powerinfer.formats.collected import CollectedData\n"
         "from powerinfer.train_predictor.train import heldout_metrics\n\n"
         "MODEL, DATA = powerinfer.DEMO_MODEL, powerinfer.DEMO_CALIBRATION\n"
         "OUT = Path('../out/notebook').resolve(); OUT.mkdir(parents=True, exist_ok=True)\n"
         "cfg = json.loads((MODEL / 'config.json').read_text())\n"
         "n_layer, n_embd, n_ff = cfg['num_hidden_layers'], cfg['hidden_size'], cfg['intermediate_size']\n"
         "print(MODEL.name, 'n_layer', n_layer, 'n_embd', n_embd, 'n_ff', n_ff, 'hidden_act', cfg['hidden_act'])\n\n"
         "def sh(*args):\n    t = time.time()\n    r = subprocess.run([str(a) for a in args], capture_output=True, text=True)\n"
         "    print(r.stdout[-4000:]); print(r.stderr[-1500:] if r.returncode else '')\n"
         "    print(f'[{args[0]}: exit {r.returncode}, {time.time() - t:.1f} s]')\n    assert r.returncode == 0"),
    md("## 1. Profile: how often does each FFN neuron fire?"),
    code("sh('pi-profile', MODEL, '--data', DATA, '--out', OUT / 'activation')"),
    code("counts = load_activation_dir(OUT / 'activation', n_layer=n_layer, n_ff=n_ff)\n"
         "stats = load_activation_stats(OUT / 'activation')\nn_tok = stats['n_tokens']\n"
         "fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))\nfor i, c in enumerate(counts):\n"
         "    f = np.sort(c.numpy())[::-1] / n_tok\n    ax[0].loglog(np.arange(1, n_ff + 1), f, label=f'layer {i}')\n"
         "    ax[1].plot(np.arange(1, n_ff + 1) / n_ff, np.cumsum(f) / f.sum(), label=f'layer {i}')\n"
         "ax[0].set(xlabel='neuron rank', ylabel='activation frequency (share of tokens)', "
         "title='Power law: few hot neurons, many cold ones')\n"
         "ax[1].set(xlabel='share of neurons (hottest first)', ylabel='share of activations covered', "
         "title='Coverage by the hottest neurons')\nax[0].legend(); ax[1].grid(alpha=.3); plt.tight_layout(); plt.show()\n"
         "for i, c in enumerate(counts):\n    s = np.sort(c.numpy())[::-1]\n"
         "    print(f'layer {i}: sparsity {1 - s.sum() / (n_tok * n_ff):.1%}, hottest 10% of neurons cover '\n"
         "          f'{s[:n_ff // 10].sum() / s.sum():.1%} of activations')"),
    md("## 2. Predictors: `fc2(relu(fc1 x))` per layer, trained on the residual stream before `ffn_norm`"),
    code("sh('pi-train-predictor', MODEL, '--data', DATA, '--out', OUT / 'predictor', '--work-dir', OUT / 'predictor-work')"),
    code("preds = load_predictor_dir(OUT / 'predictor', n_layer, n_embd, n_ff)\n"
         "data = CollectedData.open(OUT / 'predictor-work')\nthresholds = np.linspace(-4, 4, 17)\n"
         "fig, ax = plt.subplots(figsize=(7, 5))\nfor i, p in enumerate(preds):\n"
         "    x, m = data.inputs('heldout', i), data.masks('heldout', i)\n"
         "    pts = [heldout_metrics(p, x, m, n_ff, t) for t in thresholds]\n"
         "    ax.plot([q['pred_active'] for q in pts], [q['recall'] for q in pts], '.-', label=f'layer {i}')\n"
         "    at0 = heldout_metrics(p, x, m, n_ff, 0.0)\n"
         "    ax.plot(at0['pred_active'], at0['recall'], 'k*', ms=10)\n"
         "    ax.axvline(at0['true_active'], color=ax.lines[-2].get_color(), ls=':', lw=.8)\n"
         "ax.set(xlabel='predicted-active share of neurons (computed)', ylabel='recall of truly active neurons',\n"
         "       title='Held-out recall vs neurons computed (stars: threshold 0; dotted: true active share)')\n"
         "ax.legend(); ax.grid(alpha=.3); plt.show()\n"
         "for i, m in enumerate(read_predictor_config(OUT / 'predictor')['layers']):\n    print(i, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in m.items()})"),
    md("## 3. Convert: a PowerInfer GGUF (`PWRI`) with the predictors, and a dense GGUF"),
    code("sh('pi-convert', MODEL, OUT / 'predictor', '--outfile', OUT / 'demo.powerinfer.gguf')\n"
         "sh('pi-convert', MODEL, '--outfile', OUT / 'demo.gguf')\n"
         "print(open(OUT / 'demo.powerinfer.gguf', 'rb').read(4), open(OUT / 'demo.gguf', 'rb').read(4))"),
    md("## 4. Run: sparse (only predicted-active neurons) and dense, greedy"),
    code("sh('pi-run', '-m', OUT / 'demo.powerinfer.gguf', '-p', 'Once upon a time', '-n', '120', '--temp', '0', '-t', '1')\n"
         "sh('pi-run', '-m', OUT / 'demo.gguf', '-p', 'Once upon a time', '-n', '120', '--temp', '0', '-t', '1')"),
]

nb = nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})
NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
nbformat.write(nb, HERE / "demo_pipeline.ipynb")
print("wrote", HERE / "demo_pipeline.ipynb")
