#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main(){
  const long N=200000000;
  __m512 a[12]; for(int i=0;i<12;++i) a[i]=_mm512_set1_ps(0.f);
  __m512 w=_mm512_set1_ps(1e-9f), x=_mm512_set1_ps(1e-9f);
  __m512bh wb=_mm512_cvtne2ps_pbh(w,w), xb=_mm512_cvtne2ps_pbh(x,x);
  auto t0=std::chrono::steady_clock::now();
  for(long n=0;n<N/12;++n){ for(int i=0;i<12;++i) a[i]=_mm512_fmadd_ps(w,x,a[i]); asm volatile("" :: : "memory"); }
  auto t1=std::chrono::steady_clock::now();
  for(long n=0;n<N/12;++n){ for(int i=0;i<12;++i) a[i]=_mm512_dpbf16_ps(a[i],wb,xb); asm volatile("" :: : "memory"); }
  auto t2=std::chrono::steady_clock::now();
  float s=0; for(int i=0;i<12;++i) s+=_mm512_reduce_add_ps(a[i]);
  double f=std::chrono::duration<double>(t1-t0).count(), d=std::chrono::duration<double>(t2-t1).count();
  printf("fma %.3f ns/instr, dpbf16 %.3f ns/instr (ratio %.2f) %g\n", f/N*1e9, d/N*1e9, d/f, s);
}
