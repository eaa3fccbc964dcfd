#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
#include <cmath>
static float bf(uint16_t h){uint32_t b=uint32_t(h)<<16; float f; memcpy(&f,&b,4); return f;}
static float daz(float f){ if (std::fabs(f) < 1.17549435e-38f) return std::copysign(0.f, f); return f; }
int main(){
  std::mt19937 g(2); std::normal_distribution<float> n(0,1); int shown=0; long tot=0; int m=0, m2=0;
  for(int it=0; it<200000; ++it){
    float a[32], x[32], acc[16];
    for(int i=0;i<32;++i){a[i]=n(g)*std::ldexp(1.f, -int(g()%50)-100); x[i]=n(g)*std::ldexp(1.f, -int(g()%30));}
    for(int i=0;i<16;++i) acc[i]=n(g)*std::ldexp(1.f, -int(g()%40)-110);
    __m512bh A=_mm512_cvtne2ps_pbh(_mm512_loadu_ps(a+16), _mm512_loadu_ps(a));
    __m512bh X=_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x+16), _mm512_loadu_ps(x));
    uint16_t ah[32], xh[32]; memcpy(ah,&A,64); memcpy(xh,&X,64);
    __m512 r=_mm512_dpbf16_ps(_mm512_loadu_ps(acc), A, X); float rr[16]; _mm512_storeu_ps(rr,r);
    for(int j=0;j<16;++j){
      float a0=bf(ah[2*j]),a1=bf(ah[2*j+1]),x0=bf(xh[2*j]),x1=bf(xh[2*j+1]);
      double p1=(double)a1*x1, p0=(double)a0*x0;
      float s1=daz((float)((double)daz(acc[j])+p1));   // product exact in double, one rounding of the sum
      float o=daz((float)((double)s1+p0));
      m += memcmp(&o,&rr[j],4)!=0;
      float s1b=daz(daz(acc[j])+(float)p1); float ob=daz(s1b+(float)p0);
      m2 += memcmp(&ob,&rr[j],4)!=0; tot++;
      if (memcmp(&o,&rr[j],4) && shown<5){ shown++; printf("acc %a a1x1 %a a0x0 %a hw %a emu %a\n", acc[j], p1, p0, rr[j], o);}
    }
  }
  printf("lanes %ld: exact-product emulation mismatches %d, f32-product %d\n", tot, m, m2);
}
