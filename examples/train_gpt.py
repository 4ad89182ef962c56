"""Train the tiny GPT as a 2-stage pipeline, the schedule picked by a TOML config.

    python examples/train_gpt.py [examples/configs/gpt_tiny.toml]

The model (jaxreshard/models/gpt.py) is plain JAX with `jr.stage_boundary` between blocks;
everything pipeline-specific here is the decorator and its config.
"""

import sys

import jax
import optax

jax.config.update("jax_num_cpu_devices", 8)  # fake CPU devices: 2 stages x (1, 2) meshes

import jaxreshard as jr  # noqa: E402
from jaxreshard.models import gpt  # noqa: E402

path = sys.argv[1] if len(sys.argv) > 1 else "examples/configs/gpt_tiny.toml"
config = jr.PipelineConfig.from_toml(path)  # the [pipeline] table
cfg = gpt.PRESETS["tiny"]
optimizer = optax.adam(1e-3)  # any optax.GradientTransformation
step = jr.parallelize(
    gpt.train_step(cfg, num_stages=config.num_stages, optimizer=optimizer),
    config=config,
    batch_argnums=(2,),
)
params, opt_state = gpt.init_state(cfg, seed=0, optimizer=optimizer)
for i in range(20):
    batch = gpt.synthetic_batch(cfg, batch_size=16, step=i)
    params, opt_state, loss = step(params, opt_state, batch)
    print(f"step {i:2d}  loss {float(loss):.4f}")
print(step.plan(params, opt_state, batch))  # stages, meshes, boundary tensors, schedule
