import time, sys, numpy as np, jax, jax.numpy as jnp
from dflash_jax.quant import cpu_kernel
B,T,G,hd=1,int(sys.argv[2]) if len(sys.argv)>2 else 1,3,64; nKV=int(sys.argv[4]) if len(sys.argv)>4 else 3
S=int(sys.argv[1]); live=int(sys.argv[3]) if len(sys.argv)>3 else 256; L=30
rng=np.random.default_rng(0)
ck=[jnp.asarray(rng.standard_normal((B,nKV,S,hd)),jnp.float32) for _ in range(L)]; cv=[jnp.asarray(rng.standard_normal((B,nKV,S,hd)),jnp.float32) for _ in range(L)]
q=jnp.asarray(rng.standard_normal((B,T,nKV,G,hd)),jnp.float32)
none=jnp.zeros((B,0,nKV,hd),jnp.float32)
@jax.jit
def f(q,ck,cv):
    vis=jnp.broadcast_to(jnp.arange(S)[None,None,:]<live,(B,T,S))
    acc=0.
    for l in range(L):
        ll=0 if __import__("os").environ.get("HOT") else l; lo,o=cpu_kernel.attention_rows(q,(ck[ll],cv[ll],vis),(none,none,jnp.zeros((B,T,0),bool)),hd**-0.5)
        q=q+o.reshape(q.shape)*1e-3
    return q
f(q,ck,cv).block_until_ready()
ts=[]
for i in range(50):
    t=time.perf_counter(); f(q,ck,cv).block_until_ready(); ts.append(time.perf_counter()-t)
print(S,T,"median ms for 30 layers",np.median(ts)*1e3)
