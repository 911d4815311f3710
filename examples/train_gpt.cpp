// Trains a character-level GPT on a text file (default: examples/data/corpus.txt, fables the
// project generates itself), printing step, loss, tokens/s and peak memory, then saves the weights
// as safetensors and prints a sample.
//
//   train_gpt [--data PATH] [--layers 4] [--width 128] [--heads 4] [--context 64] [--batch 16]
//             [--steps 850] [--lr 3e-3] [--dropout 0.0] [--seed 1] [--log-every 50]
//             [--out gpt.safetensors] [--sample 500] [--temperature 0.8] [--top-k 10] [--legible-floor 0.9]
//             [--policy none|blocks|selective|uniform:K|sqrt|binomial:S|budget:MB] [--precision fp32|bf16]
//             [--compare-curve LABEL:PATH] [--memory BYTES] [--micro-batch N] [--offload DIR] [--offload-min BYTES]
//             [--offload-wait 0|1] [--offload-reuse 0|1]
//             [--save-every N] [--state PATH] [--resume PATH] [--losses PATH] [--trace PATH] [--check 0|1]
//
// --check 1 makes the run a self-check: it exits 1 unless the held-out loss beats the unigram
// entropy and the sample's legibility reaches --legible-floor (the main job, `--target train`, and
// the example CTests run so). Without it the same figures are printed and a short run (a trace, a
// smoke test) exits 0 whatever it learned.
//
// --save-every N writes the whole training state (weights, AdamW moments and step, the data and
// dropout generators, the step counter, the loss history) to --state (default: the --out name
// with .state.safetensors) every N steps, atomically; --resume PATH continues a run from such a
// file, and ends bitwise where the uninterrupted run ends (the same weights and losses).
// --losses PATH writes every step's loss, one per line, exactly. --die-after N (for the resume
// test) kills the process with SIGKILL after step N. --trace PATH writes the timeline of the first
// training step (every op, replay and chain action; live and saved bytes) as a Chrome trace.
//
// Data parallel (built with MPI): `mpirun -np 2 train_gpt --policy blocks` splits each step's
// global batch (--batch) across the ranks, averages the gradients with dist::DataParallel while
// backward runs, prints from rank 0 and saves one weights file; --zero 1 shards the AdamW state
// across the ranks (ZeRO stage 1); --zero 3 shards the blocks' parameters, the gradients and the
// AdamW state (ZeRO stage 3: dist::FullyShardedDataParallel, each block gathered while it runs). As root, Open MPI also needs --allow-run-as-root, and more ranks
// than cores need --oversubscribe.
//
// --policy blocks checkpoints every Transformer block: only block boundaries are kept during
// forward, and each block's forward is replayed in backward. The others run the blocks as a chain
// under that schedule (see remat/schedule/schedule.hpp) and print its plan first.
//
// --precision bf16 runs the forward of every step (and the held-out evaluation, the memory
// comparison and the sample) under remat::autocast: the matrix products on bfloat16 operands with
// float32 sums (remat/core/autocast.hpp lists the ops), PyTorch's torch.autocast("cpu",
// dtype=torch.bfloat16). Backward runs outside the guard, as in PyTorch; the weights, their
// gradients and the AdamW state stay float32. fp32 (the default) runs everything in float32. The
// training state records it: --resume continues a run only with the precision it was saved under.
//
// --compare-curve LABEL:PATH draws another run's loss curve (its .loss.csv) dashed in this run's
// SVG, labelled LABEL: README's picture is a bf16 run with the fp32 run beside it.
//
// --memory 64MB fits the run in that much training memory (the library's books: weights, their
// gradients, the AdamW state, and what a micro-batch's forward and backward allocate):
// remat::fit_in_memory measures the policies (and a MemoryBudget) on a fixed batch, prints what it
// predicted and measured, and the run takes the fastest setting that fits — a policy, or a budget
// over the activations, and a micro-batch that divides --batch, its gradients accumulated over
// the rest. Sizes take B, KB/KiB, MB/MiB, GB/GiB (all 1024-based). --micro-batch N sets the
// micro-batch by hand. The training stream is unchanged by the fit: --memory's choice, given as
// --policy and --micro-batch, trains to the same bits.
//
// --offload DIR writes the activations saved for backward of at least --offload-min bytes
// (default 64KiB) to files under DIR while the forward runs, and reads them back ahead of the
// backward (remat::Offload, remat/io/offload.hpp); the losses are bitwise those without it. The run
// ends by printing what the store wrote, read and held. --offload-wait 1 makes each backward wait
// for the writes still queued (OffloadOptions::wait_for_writes) instead of calling them off.
// --offload-reuse 1 overwrites the files a step let go in the next steps' writes instead of
// making new ones (OffloadOptions::reuse_files: quicker writes; the files stay until the run ends).
//
// Reading order: train(), at the end of the file, is the whole run on one page; each part it calls
// is a function or a small struct above it, named for what it does.
#include <algorithm>
#include <cctype>
#include <csignal>
#include <cstdio>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <remat/remat.hpp>
#ifdef REMAT_WITH_MPI
#include <remat/dist/data_parallel.hpp>
#include <remat/dist/fully_sharded.hpp>
#include <remat/dist/fully_sharded_adamw.hpp>
#include <remat/dist/sharded_adamw.hpp>
#endif

#ifndef REMAT_EXAMPLE_DATA
#define REMAT_EXAMPLE_DATA "examples/data/corpus.txt"
#endif

namespace {

using namespace remat;

struct Options {
  std::string data = REMAT_EXAMPLE_DATA;
  std::string out = "gpt.safetensors";
  std::string policy = "none";
  std::string precision = "fp32";  ///< fp32, or bf16: every forward under remat::autocast
  std::string compare_curve;  ///< LABEL:PATH, another run's loss CSV drawn dashed beside this one's
  std::int64_t layers = 4, width = 128, heads = 4, context = 64, batch = 16, steps = 850, seed = 1;
  std::int64_t log_every = 50, sample = 500, top_k = 10;
  double lr = 3e-3, dropout = 0.0, temperature = 0.8;
  double legible_floor = 0.90;  ///< with --check: fail below this share of sampled words found in the corpus
  bool check = false;           ///< exit 1 when the run did not learn (the floors above)
  std::int64_t save_every = 0, die_after = 0;
  std::int64_t zero = 0;  ///< 1: shard the optimizer state across ranks; 3: parameters and gradients too
  std::string state, resume, losses, trace;
  std::string memory;            ///< --memory: the cap remat::fit_in_memory fits the run into
  std::int64_t micro_batch = 0;  ///< rows per forward and backward; 0: the whole batch
  std::string offload;           ///< --offload DIR: saved activations written to files there
  std::string offload_min = "64KiB";  ///< the smallest saved tensor offloaded
  bool offload_wait = false;     ///< --offload-wait 1: backward waits for the queued writes
  bool offload_reuse = false;    ///< --offload-reuse 1: files let go are overwritten by later writes
  bool policy_given = false;     ///< --policy on the command line (excludes --memory)

  /// Whether forwards run under remat::autocast (--precision bf16).
  bool bf16() const { return precision == "bf16"; }
};

/// `path` without a .safetensors ending: the stem of the files written beside the weights.
std::string without_safetensors(std::string path) {
  if (const auto dot = path.rfind(".safetensors"); dot != std::string::npos) path.erase(dot);
  return path;
}

/// "64MB", "1.5GiB", "4096": a size in bytes (KB, MB, GB are 1024-based, as KiB, MiB, GiB).
std::size_t parse_bytes(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  std::string unit(end);
  for (char& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  const std::map<std::string, double> scale{{"", 1}, {"B", 1}, {"KB", 1024.0}, {"KIB", 1024.0},
                                            {"MB", 1024.0 * 1024}, {"MIB", 1024.0 * 1024},
                                            {"GB", 1024.0 * 1024 * 1024}, {"GIB", 1024.0 * 1024 * 1024}};
  const auto it = scale.find(unit);
  REMAT_CHECK(end != text.c_str() && v > 0 && it != scale.end() && v * it->second < 1e18,
              "train_gpt: --memory takes a positive size such as 64MB, 1.5GB or 4096 (bytes), got '{}'", text);
  return static_cast<std::size_t>(v * it->second);
}

Options parse(int argc, char** argv) {
  Options o;
  std::map<std::string, std::string> kv;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    REMAT_CHECK(a.rfind("--", 0) == 0, "train_gpt: unexpected argument '{}' (flags look like --steps 100)", a);
    a = a.substr(2);
    if (const auto eq = a.find('='); eq != std::string::npos) {
      kv[a.substr(0, eq)] = a.substr(eq + 1);
    } else {
      REMAT_CHECK(i + 1 < argc, "train_gpt: flag --{} needs a value", a);
      kv[a] = argv[++i];
    }
  }
  auto take_int = [&](const char* k, std::int64_t& v) {
    if (auto it = kv.find(k); it != kv.end()) {
      v = std::stoll(it->second);
      kv.erase(it);
    }
  };
  auto take_double = [&](const char* k, double& v) {
    if (auto it = kv.find(k); it != kv.end()) {
      v = std::stod(it->second);
      kv.erase(it);
    }
  };
  auto take_string = [&](const char* k, std::string& v) {
    if (auto it = kv.find(k); it != kv.end()) {
      v = it->second;
      kv.erase(it);
    }
  };
  take_string("data", o.data);
  take_string("out", o.out);
  o.policy_given = kv.count("policy") > 0;
  take_string("policy", o.policy);
  take_string("memory", o.memory);
  take_int("micro-batch", o.micro_batch);
  take_string("precision", o.precision);
  take_string("compare-curve", o.compare_curve);
  take_string("offload", o.offload);
  take_string("offload-min", o.offload_min);
  take_int("layers", o.layers);
  take_int("width", o.width);
  take_int("heads", o.heads);
  take_int("context", o.context);
  take_int("batch", o.batch);
  take_int("steps", o.steps);
  take_int("seed", o.seed);
  take_int("log-every", o.log_every);
  take_int("sample", o.sample);
  take_int("top-k", o.top_k);
  take_double("temperature", o.temperature);
  take_double("legible-floor", o.legible_floor);
  take_double("lr", o.lr);
  take_double("dropout", o.dropout);
  take_int("save-every", o.save_every);
  take_int("die-after", o.die_after);
  take_string("state", o.state);
  take_string("resume", o.resume);
  take_string("losses", o.losses);
  take_string("trace", o.trace);
  take_int("zero", o.zero);
  REMAT_CHECK(o.zero == 0 || o.zero == 1 || o.zero == 3, "train_gpt: --zero takes 0, 1 or 3 (the ZeRO stage), got {}",
              o.zero);
  std::int64_t check = 0, offload_wait = 0, offload_reuse = 0;
  take_int("check", check);
  REMAT_CHECK(check == 0 || check == 1, "train_gpt: --check takes 0 or 1, got {}", check);
  o.check = check == 1;
  take_int("offload-wait", offload_wait);
  REMAT_CHECK(offload_wait == 0 || offload_wait == 1, "train_gpt: --offload-wait takes 0 or 1, got {}", offload_wait);
  o.offload_wait = offload_wait == 1;
  take_int("offload-reuse", offload_reuse);
  REMAT_CHECK(offload_reuse == 0 || offload_reuse == 1, "train_gpt: --offload-reuse takes 0 or 1, got {}",
              offload_reuse);
  o.offload_reuse = offload_reuse == 1;
  REMAT_CHECK(kv.empty(), "train_gpt: unknown flag --{}", kv.begin()->first);
  REMAT_CHECK(o.compare_curve.empty() || o.compare_curve.find(':') != std::string::npos,
              "train_gpt: --compare-curve takes LABEL:PATH (another run's .loss.csv), got '{}'", o.compare_curve);
  REMAT_CHECK(o.precision == "fp32" || o.precision == "bf16", "train_gpt: --precision is fp32 or bf16, got {}",
              o.precision);
  if (o.state.empty()) o.state = without_safetensors(o.out) + ".state.safetensors";

  REMAT_CHECK(o.steps > 0 && o.batch > 0 && o.context > 1 && o.log_every > 0, "train_gpt: steps, batch, log-every "
              "must be positive and context above 1");
  REMAT_CHECK(o.memory.empty() || !o.policy_given, "train_gpt: --memory chooses the policy; give it or --policy, not both");
  REMAT_CHECK(o.memory.empty() || o.micro_batch == 0,
              "train_gpt: --memory chooses the micro-batch; give it or --micro-batch, not both");
  if (o.micro_batch == 0) o.micro_batch = o.batch;
  REMAT_CHECK(o.micro_batch > 0 && o.batch % o.micro_batch == 0,
              "train_gpt: --micro-batch {} must be positive and divide --batch {}", o.micro_batch, o.batch);
  return o;
}

/// A character vocabulary and the text as ids.
struct Corpus {
  std::string chars;              // id -> character
  std::vector<std::int64_t> ids;  // the text
  double unigram_entropy = 0;     // nats per character: the loss of a model that ignores context
  std::set<std::string> words;    // its vocabulary, lower-cased
};

/// The words of `text`: maximal runs of letters, lower-cased.
std::vector<std::string> words_of(const std::string& text) {
  std::vector<std::string> out;
  std::string w;
  for (const char ch : text + " ") {
    if (std::isalpha(static_cast<unsigned char>(ch))) {
      w += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    } else if (!w.empty()) {
      out.push_back(w);
      w.clear();
    }
  }
  return out;
}

Corpus load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REMAT_CHECK(in.good(), "train_gpt: cannot read {}", path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  Corpus c;
  const std::set<char> unique(text.begin(), text.end());
  c.chars.assign(unique.begin(), unique.end());
  std::array<std::int64_t, 256> id{};
  for (std::size_t i = 0; i < c.chars.size(); ++i) id[static_cast<unsigned char>(c.chars[i])] = static_cast<std::int64_t>(i);
  std::vector<double> counts(c.chars.size());
  for (char ch : text) {
    c.ids.push_back(id[static_cast<unsigned char>(ch)]);
    ++counts[static_cast<std::size_t>(c.ids.back())];
  }
  for (double n : counts) c.unigram_entropy -= n / static_cast<double>(text.size()) * std::log(n / static_cast<double>(text.size()));
  for (std::string& w : words_of(text)) c.words.insert(std::move(w));
  return c;
}

/// Random windows of context+1 characters from ids[lo, hi): inputs and next-character targets.
std::pair<LongTensor, LongTensor> batch(const std::vector<std::int64_t>& ids, std::size_t lo, std::size_t hi,
                                        std::int64_t B, std::int64_t T, Generator& gen) {
  LongTensor x(Shape{B, T}), y(Shape{B, T});
  const LongTensor starts = randint(static_cast<std::int64_t>(lo), static_cast<std::int64_t>(hi) - T - 1, {B}, gen);
  std::int64_t* px = x.data();
  std::int64_t* py = y.data();
  for (std::int64_t b = 0; b < B; ++b) {
    const auto s = static_cast<std::size_t>(starts.data()[b]);
    std::copy(ids.begin() + static_cast<std::ptrdiff_t>(s), ids.begin() + static_cast<std::ptrdiff_t>(s) + T, px + b * T);
    std::copy(ids.begin() + static_cast<std::ptrdiff_t>(s) + 1, ids.begin() + static_cast<std::ptrdiff_t>(s) + T + 1, py + b * T);
  }
  return {x, y};
}

/// Rows [first, first + n) of a (B, T) batch.
LongTensor rows(const LongTensor& t, std::int64_t first, std::int64_t n) {
  LongTensor out(Shape{n, t.size(1)});
  std::copy(t.data() + first * t.size(1), t.data() + (first + n) * t.size(1), out.data());
  return out;
}

#ifdef REMAT_WITH_MPI
/// Whether mpirun (or another MPI launcher) started this process.
bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
         std::getenv("PMIX_RANK") != nullptr;
}
#endif

std::string human_bytes(std::size_t b) {
  return b >= (1u << 20) ? fmt::format("{:.1f} MiB", static_cast<double>(b) / (1 << 20))
                         : fmt::format("{:.1f} KiB", static_cast<double>(b) / (1 << 10));
}


/// Mean loss over `batches` fixed batches of the held-out tenth, without recording, in the run's
/// precision (under autocast with --precision bf16).
double held_out_loss(nn::GPT& model, const Corpus& c, std::size_t split, std::int64_t B, std::int64_t T, int batches,
                     bool bf16) {
  no_grad guard;
  const autocast precision(bf16);
  model.eval();
  Generator eval_gen(99);  // the same batches every time, so the curve compares like with like
  double total = 0;
  for (int i = 0; i < batches; ++i) {
    auto [x, y] = batch(c.ids, split, c.ids.size(), B, T, eval_gen);
    total += model.loss(x, y).item() / batches;
  }
  model.train();
  return total;
}

struct CurvePoint {
  std::int64_t step;
  double train, held_out;
};

/// A loss curve as write_curve writes it (step,train_loss,held_out_loss).
std::vector<CurvePoint> read_curve(const std::string& path) {
  std::ifstream in(path);
  REMAT_CHECK(in.good(), "train_gpt: --compare-curve: cannot read {}", path);
  std::string line;
  std::getline(in, line);
  REMAT_CHECK(line == "step,train_loss,held_out_loss", "train_gpt: --compare-curve: {} is not a loss curve CSV "
              "(its header is '{}')", path, line);
  std::vector<CurvePoint> points;
  while (std::getline(in, line)) {
    long long step = 0;
    double train = 0, held_out = 0;
    REMAT_CHECK(std::sscanf(line.c_str(), "%lld,%lf,%lf", &step, &train, &held_out) == 3,
                "train_gpt: --compare-curve: {}: bad line '{}'", path, line);
    points.push_back({static_cast<std::int64_t>(step), train, held_out});
  }
  return points;
}

/// The loss curve as CSV and as an SVG line plot (written by hand: no plotting dependency), this
/// run's lines labelled `label`; `other` (LABEL:PATH, may be empty) adds another run's, dashed.
void write_curve(const std::vector<CurvePoint>& points, double unigram, const std::string& stem,
                 const std::string& label, const std::string& other) {
  {
    std::ofstream csv(stem + ".csv");
    csv << "step,train_loss,held_out_loss\n";
    for (const CurvePoint& p : points) csv << fmt::format("{},{:.5f},{:.5f}\n", p.step, p.train, p.held_out);
  }
  const double W = 640, H = 400, m = 56;
  struct Run {
    std::vector<CurvePoint> points;
    std::string label;
    const char* dash;
  };
  std::vector<Run> runs{{points, label, ""}};
  if (!other.empty())
    runs.push_back({read_curve(other.substr(other.find(':') + 1)), other.substr(0, other.find(':')), " stroke-dasharray=\"6 3\""});
  double top = unigram, last = 1;
  for (const Run& r : runs)
    for (const CurvePoint& p : r.points) {
      top = std::max({top, p.train, p.held_out});
      last = std::max(last, static_cast<double>(p.step));
    }
  top = std::ceil(top);
  auto X = [&](double step) { return m + step / last * (W - 2 * m); };
  auto Y = [&](double loss) { return H - m - loss / top * (H - 2 * m); };
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">train_gpt: loss per character (nats)</text>\n"
      "<line x1=\"{3}\" y1=\"{4}\" x2=\"{5}\" y2=\"{4}\" stroke=\"black\"/>\n"
      "<line x1=\"{3}\" y1=\"{4}\" x2=\"{3}\" y2=\"{3}\" stroke=\"black\"/>\n",
      W, H, W / 2, m, H - m, W - m);
  for (int i = 0; i <= static_cast<int>(top); ++i)
    svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", m - 6, Y(i) + 4, i);
  for (int i = 0; i <= 4; ++i)
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:.0f}</text>\n", X(last * i / 4), H - m + 18,
                       last * i / 4);
  svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n", W / 2, H - 14);
  svg += fmt::format("<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"#888\" stroke-dasharray=\"4 4\"/>"
                     "<text x=\"{2}\" y=\"{3:.1f}\" text-anchor=\"end\" fill=\"#888\">unigram entropy {4:.2f}</text>\n",
                     m, Y(unigram), W - m, Y(unigram) - 6, unigram);
  const std::pair<const char*, const char*> series[] = {{"train", "#1f77b4"}, {"held-out", "#d62728"}};
  int legend = 0;
  for (const Run& r : runs)
    for (int k = 0; k < 2; ++k) {
      std::string pts;
      for (const CurvePoint& p : r.points)
        pts += fmt::format("{:.1f},{:.1f} ", X(static_cast<double>(p.step)), Y(k ? p.held_out : p.train));
      svg += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{} points=\"{}\"/>\n", series[k].second,
                         r.dash, pts);
      svg += fmt::format("<text x=\"{}\" y=\"{}\" fill=\"{}\" text-anchor=\"end\">{}, {}{}</text>\n", W - m, m + 16 * legend++,
                         series[k].second, series[k].first, r.label, *r.dash ? " (dashed)" : "");
    }
  svg += "</svg>\n";
  std::ofstream(stem + ".svg") << svg;
}

std::string clock_text(double secs) {
  const auto s = static_cast<long>(secs + 0.5);
  return fmt::format("{}:{:02d}", s / 60, s % 60);
}

// ---- The parts of train() below, in the order it uses them. ----

#ifdef REMAT_WITH_MPI
using World = dist::Context;
#else
struct World {};  // no MPI in this build: always one process
#endif

/// This process's place in the run: rank 0 of 1 unless mpirun started it.
struct Ranks {
  int rank = 0, count = 1;
  std::int64_t local_batch = 0;  ///< this rank's rows of each global batch
};

Ranks join_ranks(const Options& opt, [[maybe_unused]] World* world) {
  Ranks r;
#ifdef REMAT_WITH_MPI
  if (world) {
    r.rank = world->rank();
    r.count = world->world_size();
  }
#else
  REMAT_CHECK(opt.zero == 0, "train_gpt: --zero needs MPI (this build has none)");
#endif
  REMAT_CHECK(opt.batch % r.count == 0, "train_gpt: the global batch {} does not split evenly across {} ranks", opt.batch,
              r.count);
  // Rank 0 speaks for the run; the other ranks' copies of every line would only interleave with it.
  if (r.rank != 0)
    REMAT_CHECK(std::freopen("/dev/null", "w", stdout) != nullptr, "train_gpt: cannot silence rank {}", r.rank);
  r.local_batch = opt.batch / r.count;
  return r;
}

/// Where the training text ends: the last tenth is held out.
std::size_t training_split(const Corpus& corpus, const Options& opt) {
  const std::size_t split = corpus.ids.size() * 9 / 10;
  REMAT_CHECK(split > static_cast<std::size_t>(opt.context) + 2, "train_gpt: {} is too short for context {}", opt.data, opt.context);
  return split;
}

nn::GPTConfig gpt_config(const Options& opt, const Corpus& corpus) {
  nn::GPTConfig cfg;
  cfg.vocab_size = static_cast<std::int64_t>(corpus.chars.size());
  cfg.block_size = opt.context;
  cfg.n_layer = opt.layers;
  cfg.n_head = opt.heads;
  cfg.n_embd = opt.width;
  cfg.dropout = opt.dropout;
  return cfg;
}

/// Weight decay on matrices only, not on biases, norms or embeddings' positions (GPT-2 practice).
std::vector<optim::ParamGroup> weight_decay_groups(nn::GPT& model) {
  optim::ParamGroup decay{{}, 0.1}, no_decay{{}, 0.0};
  for (auto& [name, p] : model.named_parameters()) (p->dim() >= 2 ? decay : no_decay).params.push_back(p);
  return {decay, no_decay};
}

optim::AdamWOptions adamw_options(const Options& opt) { return {opt.lr, 0.9, 0.95, 1e-8}; }

/// A tenth of the run warming up (at least one step, never all of them), then a cosine down to a tenth of --lr.
optim::WarmupCosine lr_schedule(const Options& opt) {
  const std::int64_t warmup = std::min<std::int64_t>(std::max<std::int64_t>(1, opt.steps / 10), opt.steps - 1);
  return optim::WarmupCosine(opt.lr, opt.lr / 10, warmup, opt.steps);
}

/// Bytes saved for backward by one step: at the end of forward, and their peak.
struct SavedBytes {
  std::size_t at_end = 0, peak = 0;
};

/// One step measured in each mode, whatever --policy is, so every run shows what checkpointing buys
/// on this model (the summary repeats it).
struct MemoryComparison {
  SavedBytes plain, each_block;  ///< without checkpointing, and with every block checkpointed
};

MemoryComparison compare_memory(nn::GPT& model, const LongTensor& x, const LongTensor& y, bool bf16) {
  MemoryComparison m;
  for (const bool ck : {false, true}) {
    apply_checkpointing(model, ck ? Checkpointing::each_block() : Checkpointing::none());
    const std::size_t base = memory_stats().saved_bytes;
    MemoryScope scope;
    Tensor loss;
    {
      const autocast precision(bf16);  // the run's precision: forward under it, backward outside
      loss = model.loss(x, y);
    }
    const std::size_t at_end = memory_stats().saved_bytes - base;
    loss.backward();
    (ck ? m.each_block : m.plain) = {at_end, scope.peak_saved_bytes() - base};
    fmt::print("{:<28} saved for backward at the end of forward {}, peak saved {}, peak tensor memory {}\n",
               ck ? "checkpoint every block:" : "no checkpointing:", human_bytes(at_end),
               human_bytes(scope.peak_saved_bytes() - base), human_bytes(scope.peak_bytes()));
  }
  model.zero_grad();  // these gradients are a measurement, not the first step's
  return m;
}

/// Compares the two modes on one batch, then installs the run's policy. The batch is drawn from the
/// training stream, so moving or dropping this draw would change every training batch after it.
MemoryComparison set_up_checkpointing(nn::GPT& model, const Checkpointing& checkpointing, const Options& opt,
                                      const Corpus& corpus, std::size_t split, Generator& gen) {
  auto [x, y] = batch(corpus.ids, 0, split, opt.batch, opt.context, gen);
  const MemoryComparison m = compare_memory(model, x, y, opt.bf16());
  if (checkpointing.schedule) {
    // A schedule weighs the blocks' costs: measure each block once, in the run's precision (what
    // a block saves under autocast is other bytes), and show the plan before running it.
    const LongTensor pos = arange<std::int64_t>(0, opt.context);
    const Tensor h0 = (model.wte(x) + model.wpe(pos)).detach();
    const autocast precision(opt.bf16());
    *checkpointing.costs = measure_steps(model.blocks(), h0);
    fmt::print("{}", plan(*checkpointing.schedule, opt.layers, *checkpointing.costs).str());
  }
  apply_checkpointing(model, checkpointing);
  return m;
}

/// The optimizer, clipping and loss of a step: one process's own, or under mpirun gradients
/// averaged across the ranks while backward runs and, with --zero 1, the AdamW state sharded, with
/// --zero 3 the blocks' parameters and every gradient too.
class DataParallelism {
 public:
  DataParallelism([[maybe_unused]] World* world, [[maybe_unused]] const Ranks& ranks, nn::GPT& model,
                  optim::AdamW& adamw, [[maybe_unused]] const std::vector<optim::ParamGroup>& groups,
                  [[maybe_unused]] const optim::AdamWOptions& options, [[maybe_unused]] std::int64_t zero)
      : model_(model), optimizer_(&adamw) {
#ifdef REMAT_WITH_MPI
    world_ = world;
    ranks_ = ranks.count;
    REMAT_CHECK(zero == 0 || world, "train_gpt: --zero {} shards across ranks: run under mpirun", zero);
    if (world && zero == 3) {
      fsdp_.emplace(*world, model);
      optimizer_ = &fsdp_adamw_.emplace(*fsdp_, groups, options);
    } else if (world) {
      dist::DataParallelOptions dp;
      dp.shard_gradients = zero == 1;
      ddp_.emplace(*world, model, dp);
      if (zero == 1) optimizer_ = &sharded_.emplace(*ddp_, groups, options);
    }
#endif
  }
  // DataParallel registers itself as backward's gradient observer and ShardedAdamW keeps a reference
  // to it: neither may move, so this does not either.
  DataParallelism(const DataParallelism&) = delete;
  DataParallelism& operator=(const DataParallelism&) = delete;

  optim::Optimizer& optimizer() { return *optimizer_; }

  /// f() with the model whole (every rank calls it: under --zero 3 it is a collective, and what f
  /// writes to the parameters goes back to the shards).
  template <class F>
  void with_whole_model(F&& f) {
#ifdef REMAT_WITH_MPI
    if (fsdp_) {
      auto whole = fsdp_->full_parameters();
      f();
      return;
    }
#endif
    f();
  }

  /// Whether the parameters are sharded (--zero 3): then every rank runs every forward, evaluation
  /// too, each block gathered as it runs.
  bool shards_parameters() const {
#ifdef REMAT_WITH_MPI
    return fsdp_.has_value();
#else
    return false;
#endif
  }

  /// A step begins: the peak the report gives is the last step's.
  void start_step() {
#ifdef REMAT_WITH_MPI
    if (fsdp_) fsdp_->reset_peak_memory();
#endif
  }

  /// Training is over: the model whole for good (every rank calls it). Under --zero 3 rank 0 says
  /// what its bytes were at its peak.
  void finish() {
#ifdef REMAT_WITH_MPI
    if (fsdp_) {
      const dist::ShardedMemory& m = fsdp_->peak_memory();
      if (world_->rank() == 0)
        fmt::print("ZeRO-3, rank 0 at the last step's peak: {} live = parameters {} + gradients {} + optimizer state {} + "
                   "activations saved {} + gathered blocks {} + the rest {}\n", human_bytes(m.live),
                   human_bytes(m.parameters), human_bytes(m.gradients), human_bytes(m.optimizer),
                   human_bytes(m.activations), human_bytes(m.gathered),
                   human_bytes(m.live - m.model_state() - m.activations));
      optimizer_ = nullptr;
      fsdp_adamw_.reset();
      fsdp_.reset();
    }
#endif
  }

  void clip_gradients() {
#ifdef REMAT_WITH_MPI
    if (ddp_) {
      ddp_->clip_grad_norm(1.0);
      return;
    }
    if (fsdp_) {
      fsdp_->clip_grad_norm(1.0);
      return;
    }
#endif
    optim::clip_grad_norm(model_.parameters(), 1.0);
  }

  /// The step's loss averaged over ranks (every rank calls it: it is a collective).
  double mean_loss(const Tensor& loss) {
#ifdef REMAT_WITH_MPI
    if (world_) {
      Tensor l = scalar(loss.item());  // a copy of its own: all_reduce sums in place
      dist::all_reduce(*world_, l);
      return static_cast<double>(l.item()) / ranks_;
    }
#endif
    return static_cast<double>(loss.item());
  }

 private:
  nn::GPT& model_;
  optim::Optimizer* optimizer_;
#ifdef REMAT_WITH_MPI
  World* world_ = nullptr;
  int ranks_ = 1;
  std::optional<dist::DataParallel> ddp_;
  std::optional<dist::ShardedAdamW> sharded_;
  std::optional<dist::FullyShardedDataParallel> fsdp_;
  std::optional<dist::FullyShardedAdamW> fsdp_adamw_;
#endif
};

void print_run_header(const Options& opt, const Ranks& ranks, const Corpus& corpus, const nn::GPTConfig& cfg,
                      nn::GPT& model) {
  if (ranks.count > 1)
    fmt::print("data parallel: {} ranks, {} sequences each{}\n", ranks.count, ranks.local_batch,
               opt.zero == 1   ? ", AdamW state sharded (ZeRO-1)"
               : opt.zero == 3 ? ", blocks' parameters, gradients and AdamW state sharded (ZeRO-3)"
                               : "");
  fmt::print("remat train_gpt: {} characters of {} ({} distinct), unigram entropy {:.3f} nats/char\n",
             corpus.ids.size(), opt.data, cfg.vocab_size, corpus.unigram_entropy);
  fmt::print("model: {} layers, width {}, {} heads, context {}, {} parameters; batch {}, {} steps, lr {}, {} threads, "
             "policy {}, precision {}\n", cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, model.num_parameters(),
             opt.micro_batch < opt.batch ? fmt::format("{} (micro-batches of {}, gradients accumulated)", opt.batch,
                                                       opt.micro_batch)
                                         : std::to_string(opt.batch),
             opt.steps, opt.lr, get_num_threads(), opt.policy, opt.precision);
}

/// Everything the loop carries from one step to the next, besides model and optimizer: what
/// --save-every saves with them, so that a resumed run prints and ends as the uninterrupted one.
struct History {
  double window_loss = 0;  ///< summed since the last log line
  std::int64_t window_steps = 0;
  double first_loss = 0, last_avg = 0;
  std::vector<CurvePoint> curve;
  std::vector<float> losses;  ///< every step's loss (float32, as computed)

  void add(std::int64_t step, double loss) {
    losses.push_back(static_cast<float>(loss));
    if (step == 0) first_loss = loss;
    window_loss += loss;
    ++window_steps;
  }
};

/// The whole training state, as the loop is before step `next_step`.
void save_state(const Options& opt, const Ranks& ranks, std::int64_t next_step, const Generator& gen,
                const History& h, nn::GPT& model, optim::Optimizer& optimizer) {
  io::TrainingState st;
  st.step = next_step;
  st.data_position = next_step;
  st.generators["data"] = gen.state();
  st.scalars = {{"window_loss", h.window_loss}, {"window_steps", static_cast<double>(h.window_steps)},
                {"first_loss", h.first_loss}, {"last_avg", h.last_avg}, {"precision.bf16", opt.bf16() ? 1.0 : 0.0}};
  for (std::size_t k = 0; k < h.curve.size(); ++k) {
    st.scalars[fmt::format("curve.{:06d}.step", k)] = static_cast<double>(h.curve[k].step);
    st.scalars[fmt::format("curve.{:06d}.train", k)] = h.curve[k].train;
    st.scalars[fmt::format("curve.{:06d}.held_out", k)] = h.curve[k].held_out;
  }
  if (!h.losses.empty()) st.tensors["losses"] = tensor(h.losses, {static_cast<std::int64_t>(h.losses.size())});
  if (ranks.rank == 0)
    io::save_training_state(opt.state, model, optimizer, st);
  else if (opt.zero != 0)
    (void)optimizer.state();  // a sharded state is gathered by every rank together
}

/// Loads what save_state wrote; returns the step to continue from.
std::int64_t resume(const Options& opt, Generator& gen, History& h, nn::GPT& model, optim::Optimizer& optimizer) {
  const io::TrainingState st = io::load_training_state(opt.resume, model, optimizer);
  REMAT_CHECK(st.step <= opt.steps, "train_gpt: {} is at step {}, past --steps {}", opt.resume, st.step, opt.steps);
  // A state saved before --precision existed has no entry: that run was float32.
  const auto saved_bf16 = st.scalars.find("precision.bf16");
  const std::string saved_precision = saved_bf16 != st.scalars.end() && saved_bf16->second != 0 ? "bf16" : "fp32";
  REMAT_CHECK(saved_precision == opt.precision, "train_gpt: {} was saved by a run with --precision {}; resume it with "
              "--precision {} (this run has --precision {})", opt.resume, saved_precision, saved_precision, opt.precision);
  gen.set_state(st.generators.at("data"));
  h.window_loss = st.scalars.at("window_loss");
  h.window_steps = static_cast<std::int64_t>(st.scalars.at("window_steps"));
  h.first_loss = st.scalars.at("first_loss");
  h.last_avg = st.scalars.at("last_avg");
  for (std::size_t k = 0; st.scalars.count(fmt::format("curve.{:06d}.step", k)); ++k)
    h.curve.push_back({static_cast<std::int64_t>(st.scalars.at(fmt::format("curve.{:06d}.step", k))),
                       st.scalars.at(fmt::format("curve.{:06d}.train", k)), st.scalars.at(fmt::format("curve.{:06d}.held_out", k))});
  if (st.tensors.count("losses")) h.losses = st.tensors.at("losses").to_vector();
  fmt::print("resumed from {} at step {}\n", opt.resume, st.step);
  return st.step;
}

/// This rank's rows of the next global batch. Every rank draws the whole batch, so the ranks' data
/// generators stay equal and the data are the same whatever the number of ranks.
std::pair<LongTensor, LongTensor> next_batch(const Corpus& corpus, std::size_t split, const Options& opt,
                                             const Ranks& ranks, Generator& gen) {
  auto [x, y] = batch(corpus.ids, 0, split, opt.batch, opt.context, gen);
  if (ranks.count > 1) {
    x = rows(x, ranks.rank * ranks.local_batch, ranks.local_batch);
    y = rows(y, ranks.rank * ranks.local_batch, ranks.local_batch);
  }
  return {x, y};
}

/// What a training step leaves for the report.
struct StepResult {
  Tensor loss;                        ///< this rank's loss
  std::size_t saved_at_forward_end;   ///< the bytes checkpointing is about: kept from forward for backward
};

/// One optimizer step. With bf16, forward runs under autocast and backward outside it (PyTorch's
/// pattern); the master weights, gradients and optimizer state are float32 either way. With a
/// micro-batch below the batch, each micro-batch's loss, scaled by its share of the batch, runs
/// backward in turn and the gradients accumulate.
StepResult train_step(nn::GPT& model, DataParallelism& parallel, double lr, bool bf16, const LongTensor& x,
                      const LongTensor& y, std::int64_t micro_batch) {
  parallel.optimizer().set_lr(lr);
  micro_batch = std::min(micro_batch, x.shape()[0]);  // a rank's rows are its share of the batch
  const std::int64_t accumulation = x.shape()[0] / micro_batch;
  Tensor loss;
  std::size_t saved_at_forward_end = 0;
  if (accumulation == 1) {
    {
      const autocast precision(bf16);
      loss = model.loss(x, y);
    }
    saved_at_forward_end = memory_stats().saved_bytes;
    loss.backward();
  } else {
    double sum = 0;
    for (std::int64_t k = 0; k < accumulation; ++k) {
      Tensor part;
      {
        const autocast precision(bf16);
        part = model.loss(rows(x, k * micro_batch, micro_batch), rows(y, k * micro_batch, micro_batch));
      }
      saved_at_forward_end = std::max(saved_at_forward_end, memory_stats().saved_bytes);
      (part * (1.0f / static_cast<float>(accumulation))).backward();
      sum += static_cast<double>(part.item());
    }
    loss = scalar(static_cast<float>(sum / static_cast<double>(accumulation)));
  }
  parallel.clip_gradients();
  parallel.optimizer().step();
  parallel.optimizer().zero_grad();
  return {loss, saved_at_forward_end};
}

/// The progress output: one updating line on a terminal, plain lines when piped (CI, logs). Every
/// --log-every steps it closes the loss window, evaluates the held-out loss and adds a curve point.
class ProgressReport {
 public:
  using Clock = std::chrono::steady_clock;

  explicit ProgressReport(const Options& opt) : opt_(opt) {}

  /// `held_out()` evaluates the held-out loss; it is called on log steps only.
  template <class HeldOut>
  void after_step(std::int64_t step, double loss, std::size_t saved_at_forward_end, History& h, HeldOut held_out) {
    const double elapsed = seconds_since_start();
    const double eta = elapsed / static_cast<double>(step + 1) * static_cast<double>(opt_.steps - step - 1);
    if ((step + 1) % opt_.log_every == 0 || step + 1 == opt_.steps) {
      const double secs = std::chrono::duration<double>(Clock::now() - window_start_).count();
      h.last_avg = h.window_loss / static_cast<double>(h.window_steps);
      const double held = held_out();
      h.curve.push_back({step + 1, h.last_avg, held});
      const std::string line = fmt::format(
          "step {:5d}/{}  loss {:.4f}  held-out {:.4f}  {:7.0f} tok/s  saved for backward {}  peak {}", step + 1, opt_.steps,
          h.last_avg, held, static_cast<double>(h.window_steps * opt_.batch * opt_.context) / secs,
          human_bytes(saved_at_forward_end), human_bytes(memory_stats().peak_bytes));
      if (tty_) fmt::print("\r{}  ETA {}\x1b[K", line, clock_text(eta));
      else fmt::print("{}\n", line);
      std::fflush(stdout);
      window_start_ = Clock::now();
      h.window_loss = 0;
      h.window_steps = 0;
    } else if (tty_) {
      fmt::print("\rstep {:5d}/{}  loss {:.4f}  held-out {}  ETA {}\x1b[K", step + 1, opt_.steps, loss,
                 h.curve.empty() ? std::string("-") : fmt::format("{:.4f}", h.curve.back().held_out), clock_text(eta));
      std::fflush(stdout);
    }
  }

  /// Ends the updating line.
  void finish() const {
    if (tty_) fmt::print("\n");
  }

  double seconds_since_start() const { return std::chrono::duration<double>(Clock::now() - run_start_).count(); }

 private:
  const Options& opt_;
  const bool tty_ = isatty(STDOUT_FILENO) != 0;
  const Clock::time_point run_start_ = Clock::now();
  Clock::time_point window_start_ = run_start_;
};

/// --losses: every step's loss exactly (hexadecimal floats), for comparing runs bit by bit.
void write_losses(const Options& opt, const std::vector<float>& losses) {
  if (opt.losses.empty()) return;
  std::ofstream out(opt.losses);
  for (float v : losses) out << fmt::format("{:a}\n", static_cast<double>(v));
  REMAT_CHECK(out.good(), "train_gpt: cannot write {}", opt.losses);
}

/// How readable the sample is: the share of its words that are words of the corpus. Crude, but it
/// tells a model that writes words from one that has only learned the letter frequencies.
struct SampleScore {
  double legible = 1.0;  ///< 1 when there is no sample (--sample 0): nothing to fail
  std::size_t words = 0, known = 0;
};

/// Prints --sample characters generated after a newline, and how many of their words are corpus words.
SampleScore sample_and_score(nn::GPT& model, const Corpus& corpus, const Options& opt) {
  SampleScore score;
  if (opt.sample <= 0) return score;
  const LongTensor start = tensor<std::int64_t>({static_cast<std::int64_t>(corpus.chars.find('\n'))}, {1, 1});
  Generator sample_gen(static_cast<std::uint64_t>(opt.seed) + 1000);
  const autocast precision(opt.bf16());  // the sample in the run's precision
  const LongTensor out = model.generate(start, opt.sample, opt.temperature, opt.top_k, sample_gen);
  std::string text;
  for (std::int64_t id : out.to_vector()) text += corpus.chars[static_cast<std::size_t>(id)];
  for (const std::string& w : words_of(text)) {
    ++score.words;
    score.known += corpus.words.count(w);
  }
  score.legible = score.words ? static_cast<double>(score.known) / static_cast<double>(score.words) : 0.0;
  fmt::print("sample ({} characters, temperature {}, top-k {}):\n{}\n", opt.sample, opt.temperature, opt.top_k, text);
  fmt::print("sample: {:.0f}% of words in the corpus vocabulary ({} of {}; the corpus has {} distinct words)\n",
             100 * score.legible, score.known, score.words, corpus.words.size());
  return score;
}

/// The figures of the run in one Markdown table.
void print_summary(const Options& opt, const Ranks& ranks, const Corpus& corpus, const History& h, double total_secs,
                   double held_out, const SampleScore& sample, const MemoryComparison& memory,
                   const std::string& curve_stem) {
  const double tok_s = static_cast<double>(opt.steps * opt.batch * opt.context) / total_secs;
  fmt::print("\n| run summary | |\n|---|---|\n");
  fmt::print("| steps | {} (batch {} x context {}, policy {}) |\n", opt.steps, opt.batch, opt.context, opt.policy);
  fmt::print("| precision | {} |\n", opt.bf16() ? "bf16 (forward under remat::autocast: matrix products on bfloat16 "
                                                   "operands, float32 sums; weights, gradients, AdamW state float32)"
                                                 : "fp32");
  fmt::print("| time | {:.1f} s, {:.0f} tokens/s, {} threads{} |\n", total_secs, tok_s, get_num_threads(),
             ranks.count > 1 ? fmt::format(" per rank, {} ranks", ranks.count) : "");
  fmt::print("| train loss | {:.3f} -> {:.3f} nats/char |\n", h.first_loss, h.last_avg);
  fmt::print("| held-out loss | {:.3f} nats/char (unigram entropy {:.3f}) |\n", held_out, corpus.unigram_entropy);
  if (opt.sample > 0)
    fmt::print("| sample legibility | {:.0f}% of {} words in the corpus vocabulary (floor {:.0f}%) |\n",
               100 * sample.legible, sample.words, 100 * opt.legible_floor);
  fmt::print("| saved for backward | {} without checkpointing, {} with every block checkpointed (peak {} / {}) |\n",
             human_bytes(memory.plain.at_end), human_bytes(memory.each_block.at_end), human_bytes(memory.plain.peak),
             human_bytes(memory.each_block.peak));
  fmt::print("| files | {} (weights), {}.csv and {}.svg (loss curve) |\n", opt.out, curve_stem, curve_stem);
}

/// Did the run learn? A miss is a FAIL and exit status 1 with --check 1, only a note without.
int verdict(const Options& opt, const Corpus& corpus, double held_out, const SampleScore& sample) {
  const bool learned = held_out < corpus.unigram_entropy;
  const bool readable = opt.sample == 0 || sample.legible >= opt.legible_floor;
  const char* word = opt.check ? "FAIL" : "note";
  if (!learned) fmt::print("{}: the held-out loss did not beat the unigram entropy\n", word);
  if (!readable) fmt::print("{}: the sample is below the legibility floor\n", word);
  return opt.check && !(learned && readable) ? 1 : 0;
}

/// --memory: the setting that trains fastest within the cap, measured on a batch of its own (so
/// the training stream is the run's without --memory), printed; the options take its policy and
/// micro-batch, and its budget (if it chose one) is returned.
std::optional<std::size_t> fit_memory(nn::GPT& model, Options& opt, const Ranks& ranks, const Corpus& corpus,
                                      std::size_t split) {
  if (opt.memory.empty()) return std::nullopt;
  REMAT_CHECK(ranks.count == 1, "train_gpt: --memory fits one process's training; it does not run under mpirun yet");
  Generator fit_gen(static_cast<std::uint64_t>(opt.seed) + 2000);
  const auto [x, y] = batch(corpus.ids, 0, split, opt.batch, opt.context, fit_gen);
  FitOptions fit;
  fit.memory_bytes = parse_bytes(opt.memory);
  fit.global_batch = opt.batch;
  const FitChoice choice = fit_in_memory(model, [&, x = x, y = y](std::int64_t n) {
    const autocast precision(opt.bf16());
    return model.loss(rows(x, 0, n), rows(y, 0, n));
  }, fit);
  fmt::print("{}", choice.str());
  fmt::print("fit: {:.0f} tokens/s predicted, {:.0f} measured (rows/s x context {})\n",
             choice.predicted_rows_per_s * static_cast<double>(opt.context),
             choice.measured_rows_per_s * static_cast<double>(opt.context), opt.context);
  opt.policy = choice.setting == "budget" ? "none" : choice.setting;
  opt.micro_batch = choice.micro_batch;
  return choice.activation_budget;
}

/// The whole run; each line below is one part of it, defined above.
/// What --offload's store did over the run.
void print_offload(const OffloadStats& s, const std::string& dir) {
  fmt::print("offload to {}: {} tensors written ({}, {} failed, {} over kept files), {} read back ({} late), {} "
             "declined; held in RAM at most {}, on disk at most {}; I/O thread {:.2f} s writing, {:.2f} s reading; "
             "backward waited {:.3f} s{}\n",
             dir, s.files_written, human_bytes(s.bytes_written), s.write_failures, s.files_reused, s.reads,
             s.late_reads, s.declined,
             human_bytes(s.peak_ram_bytes), human_bytes(s.peak_disk_bytes), s.write_seconds, s.read_seconds,
             s.wait_seconds, s.direct_io ? " (O_DIRECT)" : "");
  if (!s.first_write_error.empty()) fmt::print("offload: {}\n", s.first_write_error);
}

int train(int argc, char** argv, World* world) {
  Options opt = parse(argc, argv);
  const Ranks ranks = join_ranks(opt, world);
  const Corpus corpus = load(opt.data);
  const std::size_t split = training_split(corpus, opt);

  const nn::GPTConfig cfg = gpt_config(opt, corpus);
  Generator gen(static_cast<std::uint64_t>(opt.seed));  // the weights' initialization, then the training batches
  manual_seed(static_cast<std::uint64_t>(opt.seed));  // dropout draws from the default generator
  nn::GPT model(cfg, gen);
  const std::vector<optim::ParamGroup> groups = weight_decay_groups(model);
  optim::AdamW adamw(groups, adamw_options(opt));
  const optim::WarmupCosine schedule = lr_schedule(opt);

  const std::optional<std::size_t> activation_budget = fit_memory(model, opt, ranks, corpus, split);
  REMAT_CHECK(ranks.count == 1 || opt.micro_batch == opt.batch,
              "train_gpt: --micro-batch accumulates one process's gradients; it does not run under mpirun yet");
  const Checkpointing checkpointing = policy::parse(opt.policy);
  const MemoryComparison memory = set_up_checkpointing(model, checkpointing, opt, corpus, split, gen);
  REMAT_CHECK(opt.zero != 3 || (!activation_budget && opt.offload.empty()),
              "train_gpt: --zero 3 runs with the hand-placed policies; --memory and --offload are not combined with it "
              "yet");
  DataParallelism parallel(world, ranks, model, adamw, groups, adamw_options(opt), opt.zero);
  print_run_header(opt, ranks, corpus, cfg, model);

  ProgressReport progress(opt);
  History history;
  std::int64_t first_step = 0;
  if (!opt.resume.empty())
    parallel.with_whole_model([&] { first_step = resume(opt, gen, history, model, parallel.optimizer()); });
  std::optional<MemoryBudget> budget;  // one across the steps: it replays its plan while they repeat
  if (activation_budget) budget.emplace(*activation_budget);
  std::optional<Offload> offload;  // one across the steps: one I/O thread, one directory
  if (!opt.offload.empty()) {
    OffloadOptions o;
    o.directory = opt.offload;
    o.min_bytes = parse_bytes(opt.offload_min);
    o.wait_for_writes = opt.offload_wait;
    o.reuse_files = opt.offload_reuse;
    offload.emplace(o);
  }
  for (std::int64_t step = first_step; step < opt.steps; ++step) {
    reset_peak_memory_stats();
    parallel.start_step();
    std::optional<Trace> trace;
    if (!opt.trace.empty() && step == first_step) trace.emplace(opt.trace);
    // The batch and the loss stay alive until the step is reported: the reported peak includes them.
    auto [x, y] = next_batch(corpus, split, opt, ranks, gen);
    const StepResult result = train_step(model, parallel, schedule(step), opt.bf16(), x, y, opt.micro_batch);
    if (trace) {
      trace->stop();
      fmt::print("timeline of step {} written to {} (peak saved for backward {})\n", step + 1, opt.trace,
                 human_bytes(memory_stats().peak_saved_bytes));
    }
    const double loss = parallel.mean_loss(result.loss);
    history.add(step, loss);
    // Only rank 0 prints and saves the curve; the other ranks skip the evaluation.
    progress.after_step(step, loss, result.saved_at_forward_end, history, [&] {
      const bool evaluates = ranks.rank == 0 || parallel.shards_parameters();
      return evaluates ? held_out_loss(model, corpus, split, opt.batch, opt.context, 2, opt.bf16()) : 0.0;
    });
    if (opt.save_every > 0 && (step + 1) % opt.save_every == 0)
      parallel.with_whole_model([&] { save_state(opt, ranks, step + 1, gen, history, model, parallel.optimizer()); });
    if (opt.die_after > 0 && step + 1 == opt.die_after) {  // the resume test's crash
      std::fflush(stdout);
      std::raise(SIGKILL);
    }
  }
  budget.reset();
  if (offload) print_offload(offload->stats(), offload->directory());
  offload.reset();
  write_losses(opt, history.losses);
  progress.finish();
  parallel.finish();
  if (ranks.rank != 0) return 0;  // rank 0 evaluates, samples and saves the one weights file

  const double total_secs = progress.seconds_since_start();
  const double held_out = held_out_loss(model, corpus, split, opt.batch, opt.context, 8, opt.bf16());
  io::save(model, opt.out);
  const std::string curve_stem = without_safetensors(opt.out) + ".loss";
  write_curve(history.curve, corpus.unigram_entropy, curve_stem, opt.precision, opt.compare_curve);
  const SampleScore sample = sample_and_score(model, corpus, opt);
  print_summary(opt, ranks, corpus, history, total_secs, held_out, sample, memory, curve_stem);
  return verdict(opt, corpus, held_out, sample);
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<World> world;
#ifdef REMAT_WITH_MPI
  if (launched_by_mpi()) world.emplace(&argc, &argv);
#endif
  try {
    return train(argc, argv, world ? &*world : nullptr);
  } catch (const remat::Error& e) {
#ifdef REMAT_WITH_MPI
    if (world) world->abort(e.what());  // the other ranks may be waiting for this one
#endif
    fmt::print(stderr, "{}\n", e.what());
    return 2;
  }
}
