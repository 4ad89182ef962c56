import jax, numpy as np, time, cProfile, pstats
import jaxreshard as jr
from jaxreshard.models import gpt
cfg = gpt.GPTConfig(vocab=128, seq=16, hidden=32, layers=12, heads=4)
params, opt = gpt.init_state(cfg)
step = gpt.train_step(cfg, 1)
batch = gpt.synthetic_batch(cfg, 4, 0)
conf = jr.PipelineConfig(num_stages=1, num_micro_batches=1, stage_mesh_shape=(1,), mesh_axis_names=("data",), backend="local")
p = jr.parallelize(step, config=conf, batch_argnums=(2,))
jitted = jax.jit(step)
s1 = p(params, opt, batch)[:2]; s2 = jitted(params, opt, batch)[:2]
for _ in range(3):
    s1 = p(*s1, batch)[:2]; s2 = jitted(*s2, batch)[:2]
def bench(f, s):
    t=[]; 
    for _ in range(30):
        a=time.perf_counter(); o=f(*s, batch); jax.block_until_ready(o); t.append(time.perf_counter()-a); s=o[:2]
    return np.median(t)*1e3, s
print("leaves", len(jax.tree.leaves((params, opt))))
a, s1 = bench(p, s1); b, s2 = bench(jitted, s2); print(f"ours {a:.2f} ms jit {b:.2f} ms")
pr = cProfile.Profile(); pr.enable()
for _ in range(20): s1 = p(*s1, batch)[:2]; jax.block_until_ready(s1)
pr.disable(); pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
