// Writes what gpt_hvp_parity.py compares with torch.autograd.functional.hvp: a GPT's initial weights,
// one batch, a direction v (one float64 tensor per parameter), and remat's float64 loss, gradient
// and Hessian-vector product H·v, dropout off — H·v twice: by double backward (create_graph) and by
// forward-over-reverse (remat::hvp).
//
// nn::GPT's modules hold float32 parameters, so the float64 run is the GPT written out in the ops
// its modules call (gpt_loss below), in the same order. That it is the same model is checked here
// first: in float32 it gives nn::GPT's loss and gradients bit for bit, or the program fails.
//   gpt_hvp_parity OUT_DIR LAYERS WIDTH HEADS CONTEXT BATCH VOCAB
#include <map>
#include <string>

#include "parity_setup.hpp"

namespace {

using namespace remat;

template <class T>
using Weights = std::map<std::string, BasicTensor<T>>;

/// nn::GPT's loss (dropout off) in the ops its modules call, for any element type.
template <class T>
BasicTensor<T> gpt_loss(const nn::GPTConfig& cfg, const Weights<T>& w, const LongTensor& idx, const LongTensor& targets) {
  const auto at = [&](const std::string& name) -> const BasicTensor<T>& { return w.at(name); };
  BasicTensor<T> x = embedding(idx, at("transformer.wte.weight")) +
                     embedding(arange<std::int64_t>(0, idx.size(1)), at("transformer.wpe.weight"));
  for (std::int64_t l = 0; l < cfg.n_layer; ++l) {
    const std::string b = "transformer.h." + std::to_string(l) + ".";
    const auto norm = [&](const BasicTensor<T>& t, const std::string& ln) {
      return layer_norm(t, at(b + ln + ".weight"), at(b + ln + ".bias"), 1e-5);
    };
    const BasicTensor<T> packed = linear(norm(x, "ln_1"), at(b + "attn.c_attn.weight"), at(b + "attn.c_attn.bias"));
    const BasicTensor<T> attn = linear(causal_self_attention(packed, cfg.n_head, 0.0, false),
                                       at(b + "attn.c_proj.weight"), at(b + "attn.c_proj.bias"));
    x = dropout_add(attn, x, 0.0, false);
    const BasicTensor<T> hidden = bias_gelu(linear(norm(x, "ln_2"), at(b + "mlp.c_fc.weight")), at(b + "mlp.c_fc.bias"));
    x = dropout_add(linear(hidden, at(b + "mlp.c_proj.weight"), at(b + "mlp.c_proj.bias")), x, 0.0, false);
  }
  x = layer_norm(x, at("transformer.ln_f.weight"), at("transformer.ln_f.bias"), 1e-5);
  return cross_entropy(linear(x, at("lm_head.weight")), targets);
}

template <class T>
std::vector<BasicTensor<T>> in_order(nn::GPT& model, const Weights<T>& w) {
  std::vector<BasicTensor<T>> out;
  for (auto& [name, p] : model.named_parameters()) out.push_back(w.at(name));
  return out;
}

template <class T>
bool same_bits(const BasicTensor<T>& a, const BasicTensor<T>& b) {
  return a.shape() == b.shape() && std::equal(a.data(), a.data() + a.numel(), b.data());
}

}  // namespace

int main(int argc, char** argv) try {
  REMAT_CHECK(argc == 8, "usage: gpt_hvp_parity OUT_DIR LAYERS WIDTH HEADS CONTEXT BATCH VOCAB");
  const std::string dir = argv[1];
  const parity::Setup s = parity::setup(argv);
  const nn::GPTConfig& cfg = s.cfg;
  nn::GPT& model = *s.model;
  const LongTensor& idx = s.idx;
  const LongTensor& targets = s.targets;
  std::vector<std::string> names;
  for (auto& [name, p] : model.named_parameters()) names.push_back(name);

  // The written-out model is nn::GPT: the same float32 loss and gradients, bit for bit.
  Weights<float> w32;
  for (auto& [name, p] : model.named_parameters()) w32.emplace(name, *p);
  const Tensor module_loss = model.loss(idx, targets);
  const std::vector<Tensor> module_grad = grad(module_loss, in_order(model, w32));
  const Tensor ops_loss = gpt_loss(cfg, w32, idx, targets);
  const std::vector<Tensor> ops_grad = grad(ops_loss, in_order(model, w32));
  REMAT_CHECK(same_bits(module_loss.detach(), ops_loss.detach()),
              "gpt_hvp_parity: the ops-written GPT's float32 loss {} is not nn::GPT's {}", ops_loss.item(),
              module_loss.item());
  for (std::size_t i = 0; i < ops_grad.size(); ++i)
    REMAT_CHECK(same_bits(module_grad[i], ops_grad[i]),
                "gpt_hvp_parity: the ops-written GPT's float32 gradient of {} differs from nn::GPT's",
                names[i]);

  // float64: the weights widened exactly, a direction drawn per parameter, H·v by differentiating
  // ⟨∇L, v⟩ through the recorded backward.
  Weights<double> w64;
  io::TensorFile out{{"batch.idx", io::to_entry(idx)}, {"batch.targets", io::to_entry(targets)}};
  Generator directions(7);
  std::vector<DoubleTensor> v;
  for (auto& [name, p] : model.named_parameters()) {
    w64.emplace(name, to<double>(p->detach()).requires_grad_());
    v.push_back(randn<double>(p->shape(), directions));
    out.emplace("direction." + name, io::to_entry(v.back()));
  }
  const std::vector<DoubleTensor> params = in_order(model, w64);
  const DoubleTensor loss = gpt_loss(cfg, w64, idx, targets);
  GradOptions recorded;
  recorded.create_graph = true;
  const std::vector<DoubleTensor> g = grad(loss, params, recorded);
  DoubleTensor g_dot_v;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const DoubleTensor term = sum(g[i] * v[i]);
    g_dot_v = g_dot_v.defined() ? g_dot_v + term : term;
  }
  const std::vector<DoubleTensor> hv = grad(g_dot_v, params);
  const auto [value, hv_forward] = hvp(
      [&](const std::vector<DoubleTensor>& p) {
        Weights<double> w;
        for (std::size_t i = 0; i < p.size(); ++i) w.emplace(names[i], p[i]);
        return gpt_loss(cfg, w, idx, targets);
      },
      params, v);
  out.emplace("loss", io::to_entry(loss.detach()));
  for (std::size_t i = 0; i < params.size(); ++i) {
    out.emplace("grad." + names[i], io::to_entry(g[i].detach()));
    out.emplace("hvp." + names[i], io::to_entry(hv[i]));
    out.emplace("hvp_forward." + names[i], io::to_entry(hv_forward[i]));
  }
  io::write_safetensors(dir + "/remat.safetensors", out);
  fmt::print("remat float64: loss {:.12f} ({:.12f} in hvp), <g, v> {:.12f}; {} gradients and H·v (double backward, "
             "forward-over-reverse) written to {} (the ops-written GPT matched nn::GPT bitwise in float32)\n",
             loss.item(), value.item(), g_dot_v.item(), params.size(), dir);
  return 0;
} catch (const remat::Error& e) {
  fmt::print(stderr, "{}\n", e.what());
  return 2;
}
