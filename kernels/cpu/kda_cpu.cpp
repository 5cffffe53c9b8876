// Fused CPU kernels for KDA decode over page-pool states (kernels/cpu/__init__.py loads them).
// Each replaces a chain of ~15 small torch ops (gather, decay, three batched matmuls, scatter;
// conv gather, cat, product, sum, SiLU, L2 norm, scatter) with one pass per (sequence, head).
// The torch twins are kernels/kda/decode.py (naive) and models/kda.py KDALayer.decode_conv.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

}  // namespace

// One gated-delta-rule step per sequence, in place in the state pages:
//   S <- Diag(exp(g)) S;  S <- S + beta k (v - S^T k)^T;  o = S^T (scale q)
// q, k, g: [B, H, K]; v: [B, H, V]; beta: [B, H] (contiguous float32);
// state: [P, H, K, V] float32, any strides; pages: [B] int64, distinct. Returns o [B, H, V].
torch::Tensor kda_decode_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                              torch::Tensor beta, torch::Tensor state, torch::Tensor pages, double scale) {
  for (auto& [t, n] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}}) {
    check_f32(*t, n);
    *t = t->contiguous();
  }
  check_f32(state, "state");
  TORCH_CHECK(pages.scalar_type() == torch::kInt64, "pages must be int64");
  pages = pages.contiguous();
  const int64_t B = q.size(0), H = q.size(1), K = q.size(2), V = v.size(2);
  auto o = torch::empty({B, H, V}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  float* op = o.data_ptr<float>();
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t s0 = state.stride(0), s1 = state.stride(1), s2 = state.stride(2), s3 = state.stride(3);
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * H, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> pred(V), delta(V), row(V);
    for (int64_t bh = begin; bh < end; ++bh) {
      float* S = sp + pg[bh / H] * s0 + (bh % H) * s1;
      const float *qr = qp + bh * K, *kr = kp + bh * K, *gr = gp + bh * K, *vr = vp + bh * V;
      float* out = op + bh * V;
      std::fill(pred.begin(), pred.end(), 0.f);
      for (int64_t i = 0; i < K; ++i) {  // decay, and what the decayed state recalls for k
        const float decay = std::exp(gr[i]), ki = kr[i];
        float* Si = S + i * s2;
        if (s3 == 1) {
          for (int64_t j = 0; j < V; ++j) { Si[j] *= decay; pred[j] += ki * Si[j]; }
        } else {
          for (int64_t j = 0; j < V; ++j) { Si[j * s3] *= decay; pred[j] += ki * Si[j * s3]; }
        }
      }
      const float b = bp[bh];
      for (int64_t j = 0; j < V; ++j) { delta[j] = b * (vr[j] - pred[j]); out[j] = 0.f; }
      for (int64_t i = 0; i < K; ++i) {  // write, and read out with the query
        const float ki = kr[i], qi = fscale * qr[i];
        float* Si = S + i * s2;
        if (s3 == 1) {
          for (int64_t j = 0; j < V; ++j) { Si[j] += ki * delta[j]; out[j] += qi * Si[j]; }
        } else {
          for (int64_t j = 0; j < V; ++j) { Si[j * s3] += ki * delta[j]; out[j] += qi * Si[j * s3]; }
        }
      }
    }
  });
  return o;
}

// KDA's short convolution for one new token per sequence, conv tails in pool pages, in place:
// for each (b, h, which in q/k/v): x = SiLU(sum_{j<K-1} tail[j] * taps[j] + new * taps[K-1]);
// q and k L2-normalised over the head dim (eps 1e-6 inside the sqrt); tails shift by one token.
// mixed: [B, 3*H*D] (channel = which*H*D + h*D + d); tails: [P, H, 3, K-1, D] float32, any
// strides; taps: [H, 3, K, D] contiguous; pages: [B] int64. Returns qkv [B, H, 3, D].
torch::Tensor kda_conv_step(torch::Tensor mixed, torch::Tensor tails, torch::Tensor taps, torch::Tensor pages) {
  check_f32(mixed, "mixed");
  check_f32(tails, "tails");
  check_f32(taps, "taps");
  mixed = mixed.contiguous();
  taps = taps.contiguous();
  TORCH_CHECK(pages.scalar_type() == torch::kInt64, "pages must be int64");
  pages = pages.contiguous();
  const int64_t B = mixed.size(0), H = taps.size(0), KK = taps.size(2), D = taps.size(3);
  TORCH_CHECK(tails.size(3) == KK - 1 && tails.size(4) == D && tails.size(1) == H, "tails shape mismatch");
  TORCH_CHECK(mixed.size(1) == 3 * H * D, "mixed must be [B, 3*H*D]");
  auto out = torch::empty({B, H, 3, D}, mixed.options());
  const float *mp = mixed.data_ptr<float>(), *wp = taps.data_ptr<float>();
  float *tp = tails.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t t0 = tails.stride(0), t1 = tails.stride(1), t2 = tails.stride(2), t3 = tails.stride(3),
                t4 = tails.stride(4);
  at::parallel_for(0, B * H, 8, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      for (int64_t w = 0; w < 3; ++w) {
        const float* x = mp + b * 3 * H * D + w * H * D + h * D;
        const float* tap = wp + ((h * 3 + w) * KK) * D;
        float* tail = tp + pg[b] * t0 + h * t1 + w * t2;
        float* y = op + ((b * H + h) * 3 + w) * D;
        float sq = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          float acc = 0.f;
          for (int64_t j = 0; j < KK - 1; ++j) acc += tail[j * t3 + d * t4] * tap[j * D + d];
          acc += x[d] * tap[(KK - 1) * D + d];
          const float s = acc / (1.f + std::exp(-acc));
          y[d] = s;
          sq += s * s;
          for (int64_t j = 0; j + 1 < KK - 1; ++j) tail[j * t3 + d * t4] = tail[(j + 1) * t3 + d * t4];
          if (KK > 1) tail[(KK - 2) * t3 + d * t4] = x[d];
        }
        if (w < 2) {
          const float norm = std::sqrt(sq + 1e-6f);
          for (int64_t d = 0; d < D; ++d) y[d] /= norm;
        }
      }
    }
  });
  return out;
}

// Several new tokens per sequence, decode-shaped: for each (sequence, head), its rows in order run
// KDA's short conv (as kda_conv_step) and one gated-delta-rule step (as kda_decode_step), each row
// reading the state and conv tails the previous row left and writing its own into the page
// dst_pages[row] (the first row reads src_pages[b]). Speculative verification chains a sequence's
// k + 1 tokens through k position pages and its own page this way: every intermediate state lands
// in a page of its own, with no gather, copy or scatter. A row whose dst page is the page it reads
// updates it in place (a plain decode step).
// mixed: [N, 3*H*D]; g: [N, H, D]; beta: [N, H]; state: [P, H, D, V] float32, any strides;
// tails: [P, H, 3, KK-1, D] float32, any strides; taps: [H, 3, KK, D]; src_pages: [B] int64;
// dst_pages: [N] int64; cu_rows: [B + 1] int64 (sequence b owns rows cu_rows[b] .. cu_rows[b+1]-1).
// Pages written by one sequence are written by no other. Returns o [N, H, V].
torch::Tensor kda_decode_tokens(torch::Tensor mixed, torch::Tensor g, torch::Tensor beta, torch::Tensor state,
                                torch::Tensor tails, torch::Tensor taps, torch::Tensor src_pages,
                                torch::Tensor dst_pages, torch::Tensor cu_rows, double scale) {
  for (auto& [t, n] : {std::pair{&mixed, "mixed"}, {&g, "g"}, {&beta, "beta"}, {&taps, "taps"}}) {
    check_f32(*t, n);
    *t = t->contiguous();
  }
  check_f32(state, "state");
  check_f32(tails, "tails");
  for (auto& [t, n] : {std::pair{&src_pages, "src_pages"}, {&dst_pages, "dst_pages"}, {&cu_rows, "cu_rows"}}) {
    TORCH_CHECK(t->scalar_type() == torch::kInt64, n, " must be int64");
    *t = t->contiguous();
  }
  const int64_t N = mixed.size(0), H = taps.size(0), KK = taps.size(2), D = taps.size(3);
  const int64_t B = src_pages.size(0), V = state.size(3);
  TORCH_CHECK(cu_rows.size(0) == B + 1 && dst_pages.size(0) == N, "cu_rows must be [B + 1], dst_pages [N]");
  TORCH_CHECK(mixed.size(1) == 3 * H * D && g.size(0) == N && beta.size(0) == N, "mixed/g/beta shape mismatch");
  TORCH_CHECK(state.size(1) == H && state.size(2) == D && tails.size(1) == H && tails.size(3) == KK - 1 &&
              tails.size(4) == D, "state/tails shape mismatch");
  TORCH_CHECK(V == D, "kda_decode_tokens: the conv's v head dim must equal the state's value dim");
  auto o = torch::empty({N, H, V}, mixed.options());
  const float *mp = mixed.data_ptr<float>(), *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const float* wp = taps.data_ptr<float>();
  float *sp = state.data_ptr<float>(), *tp = tails.data_ptr<float>(), *op = o.data_ptr<float>();
  const int64_t *src = src_pages.data_ptr<int64_t>(), *dst = dst_pages.data_ptr<int64_t>(),
                *cu = cu_rows.data_ptr<int64_t>();
  const int64_t s0 = state.stride(0), s1 = state.stride(1), s2 = state.stride(2), s3 = state.stride(3);
  const int64_t t0 = tails.stride(0), t1 = tails.stride(1), t2 = tails.stride(2), t3 = tails.stride(3),
                t4 = tails.stride(4);
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * H, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> qkv(3 * D), pred(V), delta(V), window((KK - 1) * D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      int64_t page = src[b];
      for (int64_t r = cu[b]; r < cu[b + 1]; ++r) {
        const int64_t out_page = dst[r];
        // Short conv: the tails of `page` and this row's input; the shifted tails go to `out_page`.
        for (int64_t w = 0; w < 3; ++w) {
          const float* x = mp + r * 3 * H * D + w * H * D + h * D;
          const float* tap = wp + ((h * 3 + w) * KK) * D;
          const float* tail = tp + page * t0 + h * t1 + w * t2;
          float* tail_out = tp + out_page * t0 + h * t1 + w * t2;
          float* y = qkv.data() + w * D;
          float sq = 0.f;
          for (int64_t d = 0; d < D; ++d) {
            float acc = 0.f;
            for (int64_t j = 0; j < KK - 1; ++j) {
              const float prev = tail[j * t3 + d * t4];
              window[j * D + d] = prev;
              acc += prev * tap[j * D + d];
            }
            acc += x[d] * tap[(KK - 1) * D + d];
            const float s = acc / (1.f + std::exp(-acc));
            y[d] = s;
            sq += s * s;
          }
          for (int64_t d = 0; d < D; ++d) {  // read all of `page`'s tail first: out_page may be page
            for (int64_t j = 0; j + 1 < KK - 1; ++j) tail_out[j * t3 + d * t4] = window[(j + 1) * D + d];
            if (KK > 1) tail_out[(KK - 2) * t3 + d * t4] = x[d];
          }
          if (w < 2) {
            const float norm = std::sqrt(sq + 1e-6f);
            for (int64_t d = 0; d < D; ++d) y[d] /= norm;
          }
        }
        // One gated-delta-rule step from `page`'s state into `out_page`'s.
        const float *qr = qkv.data(), *kr = qkv.data() + D, *vr = qkv.data() + 2 * D;
        const float* gr = gp + (r * H + h) * D;
        const float* S_in = sp + page * s0 + h * s1;
        float* S = sp + out_page * s0 + h * s1;
        float* out = op + (r * H + h) * V;
        float* pr = pred.data();
        float* dl = delta.data();
        std::fill(pred.begin(), pred.end(), 0.f);
        for (int64_t i = 0; i < D; ++i) {
          const float decay = std::exp(gr[i]), ki = kr[i];
          const float* Si_in = S_in + i * s2;
          float* Si = S + i * s2;
          if (s3 == 1) {  // contiguous value columns: vectorisable
            for (int64_t j = 0; j < V; ++j) { const float x = Si_in[j] * decay; Si[j] = x; pr[j] += ki * x; }
          } else {
            for (int64_t j = 0; j < V; ++j) { const float x = Si_in[j * s3] * decay; Si[j * s3] = x; pr[j] += ki * x; }
          }
        }
        const float b_ = bp[r * H + h];
        for (int64_t j = 0; j < V; ++j) { dl[j] = b_ * (vr[j] - pr[j]); out[j] = 0.f; }
        for (int64_t i = 0; i < D; ++i) {
          const float ki = kr[i], qi = fscale * qr[i];
          float* Si = S + i * s2;
          if (s3 == 1) {
            for (int64_t j = 0; j < V; ++j) { Si[j] += ki * dl[j]; out[j] += qi * Si[j]; }
          } else {
            for (int64_t j = 0; j < V; ++j) { Si[j * s3] += ki * dl[j]; out[j] += qi * Si[j * s3]; }
          }
        }
        page = out_page;
      }
    }
  });
  return o;
}

// MoE routing (sigmoid scores already computed) straight to the dense per-expert weights the
// all-experts inference path multiplies by: choice = scores + bias; with groups, each group's score
// is the sum of its top-2 choices and only the best topk_group groups stay; the top_k choices
// among them are the experts; weight = score (renormalised over the chosen, optional) x scaling.
// Ties go to the lower index. scores: [N, E] float32; bias: [E]. Returns [N, E + num_shared]
// (the shared experts' columns are 1). Twin: models/mlp.py Router.forward + scatter.
torch::Tensor moe_route_dense(torch::Tensor scores, torch::Tensor bias, int64_t top_k, int64_t num_groups,
                              int64_t topk_group, bool renormalize, double scaling, int64_t num_shared) {
  check_f32(scores, "scores");
  check_f32(bias, "bias");
  scores = scores.contiguous();
  bias = bias.contiguous();
  const int64_t N = scores.size(0), E = scores.size(1);
  TORCH_CHECK(bias.numel() == E && num_groups >= 1 && E % num_groups == 0 && top_k >= 1 && top_k <= E,
              "moe_route_dense: bad sizes");
  auto dense = torch::zeros({N, E + num_shared}, scores.options());
  const float *sp = scores.data_ptr<float>(), *bp = bias.data_ptr<float>();
  float* dp = dense.data_ptr<float>();
  const int64_t per_group = E / num_groups;
  const float fscale = static_cast<float>(scaling);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> choice(E), group_score(num_groups);
    std::vector<int64_t> ids(top_k);
    std::vector<char> taken(std::max(E, num_groups));
    for (int64_t n = begin; n < end; ++n) {
      const float* s = sp + n * E;
      for (int64_t e = 0; e < E; ++e) choice[e] = s[e] + bp[e];
      if (topk_group < num_groups) {
        for (int64_t gi = 0; gi < num_groups; ++gi) {  // top-2 sum (top-1 when groups have one expert)
          const float* c = choice.data() + gi * per_group;
          float a = neg_inf, b = neg_inf;
          for (int64_t j = 0; j < per_group; ++j) {
            if (c[j] > a) { b = a; a = c[j]; } else if (c[j] > b) { b = c[j]; }
          }
          group_score[gi] = per_group >= 2 ? a + b : a;
        }
        std::fill(taken.begin(), taken.end(), 0);
        for (int64_t t = 0; t < topk_group; ++t) {
          int64_t best = -1;
          for (int64_t gi = 0; gi < num_groups; ++gi)
            if (!taken[gi] && (best < 0 || group_score[gi] > group_score[best])) best = gi;
          taken[best] = 1;
        }
        for (int64_t gi = 0; gi < num_groups; ++gi)
          if (!taken[gi]) std::fill(choice.begin() + gi * per_group, choice.begin() + (gi + 1) * per_group, neg_inf);
      }
      std::fill(taken.begin(), taken.end(), 0);
      for (int64_t t = 0; t < top_k; ++t) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
          if (!taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
        taken[best] = 1;
        ids[t] = best;
      }
      float* row = dp + n * (E + num_shared);
      if (renormalize) {
        float total = 0.f;
        for (int64_t t = 0; t < top_k; ++t) total += s[ids[t]];
        const float denom = total + 1e-20f;
        for (int64_t t = 0; t < top_k; ++t) row[ids[t]] = (s[ids[t]] / denom) * fscale;
      } else {
        for (int64_t t = 0; t < top_k; ++t) row[ids[t]] = s[ids[t]] * fscale;
      }
      for (int64_t j = 0; j < num_shared; ++j) row[E + j] = 1.f;
    }
  });
  return dense;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_route_dense", &moe_route_dense, "MoE routing to dense per-expert weights");
  m.def("kda_decode_step", &kda_decode_step, "KDA decode step in pool pages (in place)");
  m.def("kda_conv_step", &kda_conv_step, "KDA short conv for one token, tails in pool pages (in place)");
  m.def("kda_decode_tokens", &kda_decode_tokens, "KDA conv + decode over several tokens per sequence, chained through pages");
}
