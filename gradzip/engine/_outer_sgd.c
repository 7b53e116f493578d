/* DiLoCo's outer SGD step and merge in one pass per tensor (see gradzip/engine/outer_step.py):
 * compiled on first use by the same builder as gradzip's other CPU kernels
 * (gradzip/compress/native.py), with the same flags.
 *
 * -ffp-contract=off: no FMA the source does not ask for; this kernel asks (fmaf) exactly where
 * torch's vectorized add-with-alpha fuses, so that its floats are those of torch.optim.SGD.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Whether this build has FMA (gz_outer_sgd does nothing without it). */
int gz_has_fma(void)
{
#ifdef __FMA__
    return 1;
#else
    return 0;
#endif
}

/* One step of torch.optim.SGD on theta[0:n] with gradient g, momentum buffer buf (NULL without
 * momentum; with first, it is started as a copy of the decayed gradient), then each of the
 * ntargets targets = theta (DiLoCo's merge). The floats of torch's AVX2/AVX-512 CPU kernels, in
 * step()'s order: add with alpha is fma(other, alpha, self), mul one rounding. g is not written.
 * Returns 0 (nothing done) when built without FMA, where those kernels do not fuse either. */
int gz_outer_sgd(float *theta, const float *g, float *buf, int64_t n, float neg_lr, float mom,
                 float keep, float wd, int nesterov, int first, float *const *targets, int64_t ntargets)
{
#ifndef __FMA__
    (void)theta; (void)g; (void)buf; (void)n; (void)neg_lr; (void)mom; (void)keep; (void)wd;
    (void)nesterov; (void)first; (void)targets; (void)ntargets;
    return 0;
#else
    for (int64_t i0 = 0; i0 < n; i0 += 4096) { /* blocks: the targets' copies read theta from L1 */
        int64_t i1 = i0 + 4096 < n ? i0 + 4096 : n;
        for (int64_t i = i0; i < i1; i++) {
            float d = g[i];
            if (wd != 0.0f)
                d = fmaf(theta[i], wd, d);
            if (buf) {
                float b = first ? d : fmaf(d, keep, buf[i] * mom);
                buf[i] = b;
                d = nesterov ? fmaf(b, mom, d) : b;
            }
            theta[i] = fmaf(d, neg_lr, theta[i]);
        }
        for (int64_t t = 0; t < ntargets; t++)
            memcpy(targets[t] + i0, theta + i0, (size_t)(i1 - i0) * sizeof(float));
    }
    return 1;
#endif
}
