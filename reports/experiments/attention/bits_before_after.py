import sys, numpy as np, jax, jax.numpy as jnp
from dflash_jax.quant import cpu_kernel
out = {}; HM = sys.argv[1] != "save"
rng = np.random.default_rng(3)
cases = [(1,1,3,3,64,300,0,'prefix'),(1,4,3,3,64,300,4,'causal'),(1,8,3,3,64,513,8,'causal'),(1,17,3,3,64,200,17,'tree'),
         (2,3,2,4,128,50,3,'rand'),(3,1,1,1,16,9,0,'rand'),(1,40,3,3,64,40,40,'causal'),(2,5,2,3,32,0,5,'tree'),
         (1,9,3,3,64,1024,9,'tree'),(4,2,2,2,8,33,2,'rand'),(1,70,3,3,64,10,70,'causal')]
for i,(B,T,nKV,G,hd,S,Tk,kind) in enumerate(cases):
    a=lambda *s: jnp.asarray(rng.standard_normal(s)*2,jnp.float32)
    q=a(B,T,nKV,G,hd)
    if kind=='rand':
        vc=rng.random((B,T,S))<0.7; vf=rng.random((B,T,Tk))<0.6
    else:
        lens=rng.integers(0,S+1,size=B)
        vc=np.broadcast_to(np.arange(S)[None,None,:]<lens[:,None,None],(B,T,S)).copy()
        if kind=='tree':
            par=[-1]+[int(rng.integers(0,j)) if j>0 else -1 for j in range(1,Tk)]
            vf=np.zeros((Tk,Tk),bool)
            for j in range(Tk):
                k=j
                while k>=0: vf[j,k]=True; k=par[k] if k>0 else -1
            vf=np.broadcast_to(vf[None],(B,T,Tk)).copy()
        else:
            vf=np.broadcast_to(np.tril(np.ones((T,Tk),bool))[None],(B,T,Tk)).copy()
    cached=(a(B,S,nKV,hd),a(B,S,nKV,hd),jnp.asarray(vc,jnp.uint8)); fresh=(a(B,Tk,nKV,hd),a(B,Tk,nKV,hd),jnp.asarray(vf,jnp.uint8))
    if HM: cached=(cached[0].transpose(0,2,1,3),cached[1].transpose(0,2,1,3),cached[2])
    l,o=jax.jit(cpu_kernel.attention_rows,static_argnums=3)(q,cached,fresh,hd**-0.5)
    out[f'{i}-l']=np.asarray(l); out[f'{i}-o']=np.asarray(o)
if sys.argv[1]=='save': np.savez(sys.argv[2],**out); print('saved',len(out))
else:
    ref=np.load(sys.argv[2]); bad=[k for k in ref.files if not np.array_equal(ref[k],out[k])]
    print('compared',len(ref.files),'mismatch',bad)
    for k in bad: print(k, np.abs(ref[k]-out[k]).max())
