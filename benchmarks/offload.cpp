// What offloading saved activations to disk costs in step time and saves in RAM: one GPT step per
// setting, settings alternating round by round, medians and ranges; the disk's own direct-I/O
// bandwidth measured in the same run, before and after.
//
//   bench_offload [--layers 8] [--width 256] [--heads 4] [--context 128] [--batch 8] [--vocab 256]
//                 [--dropout 0.1] [--rounds 7] [--dir /var/tmp] [--min 1048576] [--prefetch 4] [--direct 1]
//                 [--curve 0] [--reuse 0]
//
// Settings: blocks in RAM; blocks with its boundaries offloaded (SavedBy::checkpoint); none in RAM;
// none with every saved tensor of at least --min offloaded; and both offloads again with
// OffloadOptions::reuse_files (each step overwrites the files the one before it kept; the warm-up
// round makes them). Columns: the step's wall time (forward and backward); each round's step time
// over the same round's step of the same policy in RAM, median and range (paired: a drift of the
// machine's speed across rounds cancels); what the step holds for backward when its forward ends
// (memory_stats()'s live bytes above the step's start, the store's tensors still waiting for their
// write included; median and range over the rounds); the step's peak of live bytes above its
// start, the store's own peak RAM (waiting writes and the read-ahead arena), the saved-for-backward
// books' peak (what nodes hold themselves) and the bytes written, in the last round; late reads of
// reads, over all rounds; and whether the gradients are bitwise those of the same policy in RAM.
//
// --curve 1: the trade curve instead (benchmarks/offload_curve.py plots it): one JSON line per
// setting — hand-placed policies in RAM, MemoryBudget alone at fractions of no checkpointing's
// activation peak, offload alone (everything of at least 4 MiB, 1 MiB, 256 KiB; blocks' boundaries),
// a budget with an Offload inside it (the offload takes what is ≥ 4 MiB, the budget keeps and may
// discard the rest), and a budget that writes what it would discard to disk where that is quicker
// than recomputing it (BudgetOffload) — each with its step time and the RAM the step adds at its peak.
// --reuse 1: the offload rows of the curve with reuse_files.

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>

#include <fcntl.h>
#include <unistd.h>

#include "flags.hpp"
#include "remat/io/offload.hpp"

using namespace remat;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

/// GB/s writing then reading `bytes` in 1 MiB O_DIRECT pieces (buffered where O_DIRECT is refused).
std::pair<double, double> disk_bandwidth(const std::string& dir, std::size_t bytes) {
  const std::string path = dir + "/remat-bench-bandwidth.bin";
  constexpr std::size_t piece = std::size_t{1} << 20;
  void* buffer = std::aligned_alloc(4096, piece);
  std::memset(buffer, 0x5a, piece);
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0600);
  if (fd < 0) fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REMAT_CHECK(fd >= 0, "bench_offload: cannot write {}", path);
  auto t = Clock::now();
  for (std::size_t done = 0; done < bytes; done += piece) REMAT_CHECK(detail::write_fully(fd, buffer, piece), "write");
  ::fdatasync(fd);
  ::close(fd);
  const double write = static_cast<double>(bytes) / seconds_since(t) / 1e9;
  fd = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  if (fd < 0) fd = ::open(path.c_str(), O_RDONLY);
  t = Clock::now();
  for (std::size_t done = 0; done < bytes; done += piece) detail::read_fully(fd, buffer, piece, path, "bench");
  const double read = static_cast<double>(bytes) / seconds_since(t) / 1e9;
  ::close(fd);
  ::unlink(path.c_str());
  std::free(buffer);
  return {write, read};
}

struct Setting {
  std::string name;
  std::string policy;          // apply_checkpointing's (policy::parse), or "none"
  bool offload = false;
  bool boundaries_only = false;  // offload only what checkpoint() saves
  std::size_t min_bytes = 0;     // offload what is at least this (when not boundaries_only)
  double budget_fraction = 0;    // > 0: a MemoryBudget of this fraction of none's activation peak
  bool budget_disk = false;      // the budget may write outputs to disk (BudgetOffload) where quicker
  bool reuse = false;            // the offload with reuse_files
};
struct Sample {
  double ms;
  std::size_t held, peak, store_peak, books_peak, written, late, reads, called_off;
  std::size_t activation_peak;  // the saved-activation books' peak (what a budget caps)
  std::size_t discards, to_disk;  // a budget's: discards, and of them those written to disk
  double forward_ms, wait_ms, write_ms, read_ms;
  bool infeasible;  // the budget could not hold the step
  std::vector<std::vector<float>> grads;
};

Sample step(nn::GPT& gpt, const Setting& s, const OffloadOptions& base, std::size_t budget_bytes,
            const LongTensor& idx, const LongTensor& targets) {
  apply_checkpointing(gpt, s.policy == "none" ? Checkpointing::none() : policy::parse(s.policy));
  for (Tensor* p : gpt.parameters()) p->zero_grad();
  manual_seed(2);
  Sample out{};
  const std::size_t start = memory_stats().live_bytes, activations = memory_stats().saved_activation_bytes;
  MemoryScope scope;
  const auto t = Clock::now();
  {
    std::optional<MemoryBudget> budget;  // outside the offload: stores nest, the inner one asked first
    if (s.budget_fraction > 0 && s.budget_disk) budget.emplace(budget_bytes, BudgetOffload{base.directory});
    else if (s.budget_fraction > 0) budget.emplace(budget_bytes);
    std::optional<Offload> offload;
    if (s.offload) {
      OffloadOptions o = base;
      o.min_bytes = s.min_bytes;
      o.reuse_files = o.reuse_files || s.reuse;
      if (s.boundaries_only) {
        o.min_bytes = 0;
        o.only = [](const AnyTensor&, const SaveContext& c) { return c.by == SavedBy::checkpoint; };
      }
      offload.emplace(o);
    }
    Tensor loss = gpt.loss(idx, targets);
    out.forward_ms = seconds_since(t) * 1e3;
    out.held = memory_stats().live_bytes - start;
    try {
      loss.backward();
    } catch (const Error&) {
      if (!budget || budget->least_feasible_bytes() == 0) throw;
      out.infeasible = true;  // the gradients are complete; the step went over the cap
    }
    if (budget) {
      out.discards = budget->last_log().discards;
      out.to_disk = budget->last_log().to_disk;
      out.written = budget->last_log().disk_bytes;
    }
    if (offload) {
      const OffloadStats st = offload->stats();
      out.store_peak = st.peak_ram_bytes;
      out.written = st.bytes_written;
      out.late = st.late_reads;
      out.reads = st.reads;
      out.called_off = st.writes_called_off;
      out.wait_ms = st.wait_seconds * 1e3;
      out.write_ms = st.write_seconds * 1e3;
      out.read_ms = st.read_seconds * 1e3;
    }
  }
  out.ms = seconds_since(t) * 1e3;
  out.peak = scope.peak_bytes() - start;
  out.books_peak = scope.peak_saved_bytes() - scope.start_saved_bytes();
  out.activation_peak = scope.peak_saved_activation_bytes() - activations;
  for (Tensor* p : gpt.parameters()) out.grads.push_back(p->grad().to_vector());
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  bench::Flags a = bench::parse_flags(argc, argv,
                                      {{"layers", "8"}, {"width", "256"}, {"heads", "4"}, {"context", "128"},
                                       {"batch", "8"}, {"vocab", "256"}, {"dropout", "0.1"}, {"rounds", "7"},
                                       {"dir", "/var/tmp"}, {"min", "1048576"}, {"prefetch", "4"},
                                       {"direct", "1"}, {"curve", "0"}, {"reuse", "0"}},
                                      "bench_offload");
  const nn::GPTConfig cfg = bench::gpt_config(a, std::stod(a["dropout"]));
  const std::int64_t B = std::stoll(a["batch"]), T = cfg.block_size;
  const int rounds = std::stoi(a["rounds"]);
  Generator data(3);
  const LongTensor idx = randint(0, cfg.vocab_size, {B, T}, data), targets = randint(0, cfg.vocab_size, {B, T}, data);
  OffloadOptions base;
  base.directory = a["dir"];
  base.min_bytes = std::stoull(a["min"]);
  base.prefetch = std::stoull(a["prefetch"]);
  base.direct_io = a["direct"] != "0";
  base.reuse_files = a["curve"] != "0" && a["reuse"] != "0";

  const bool curve = a["curve"] != "0";
  std::vector<Setting> settings;
  if (!curve) {
    settings = {{"blocks, in RAM", "blocks"},
                {"blocks, boundaries offloaded", "blocks", true, true},
                {"none, in RAM", "none"},
                {"none, offloaded >= min", "none", true, false, base.min_bytes},
                {"blocks, boundaries offloaded, files reused", "blocks", true, true, 0, 0, false, true},
                {"none, offloaded >= min, files reused", "none", true, false, base.min_bytes, 0, false, true}};
  } else {
    for (const char* p : {"none", "blocks", "selective", "uniform:2", "sqrt", "binomial:4"}) settings.push_back({p, p});
    for (double f : {0.6, 0.4, 0.25, 0.15, 0.08}) settings.push_back({fmt::format("budget {}", f), "none", false, false, 0, f});
    for (std::size_t m : {std::size_t{4} << 20, std::size_t{1} << 20, std::size_t{256} << 10})
      settings.push_back({fmt::format("offload >= {} KiB", m >> 10), "none", true, false, m});
    settings.push_back({"blocks, boundaries offloaded", "blocks", true, true});
    // The offload takes the largest tensors (4 MiB: the MLP's hidden activations, the attention's
    // probabilities), the budget keeps the rest and discards among them: with --min's 1 MiB the
    // offload would take nearly everything and leave the budget nothing to decide.
    for (double f : {0.3, 0.2, 0.1})
      settings.push_back({fmt::format("budget {} + offload >= 4096 KiB", f), "none", true, false, std::size_t{4} << 20, f});
    for (double f : {0.25, 0.15, 0.08})
      settings.push_back({fmt::format("budget {}, disk or recompute", f), "none", false, false, 0, f, true});
  }
  Generator init(1);
  nn::GPT model(cfg, init);
  const auto [w0, r0] = disk_bandwidth(a["dir"], std::size_t{512} << 20);
  // The budgets are fractions of no checkpointing's activation peak, measured first.
  const std::size_t free_activations = step(model, {"none", "none"}, base, 0, idx, targets).activation_peak;
  std::vector<std::vector<Sample>> samples(settings.size());
  for (int r = 0; r < rounds + 1; ++r)  // round 0 warms up
    for (std::size_t i = 0; i < settings.size(); ++i) {
      const auto bytes = static_cast<std::size_t>(settings[i].budget_fraction * static_cast<double>(free_activations));
      Sample s = step(model, settings[i], base, bytes, idx, targets);
      if (r > 0) samples[i].push_back(std::move(s));
    }
  const auto [w1, r1] = disk_bandwidth(a["dir"], std::size_t{512} << 20);
  if (curve) {
    fmt::print("{{\"disk_write_gbs\": [{:.3f}, {:.3f}], \"disk_read_gbs\": [{:.3f}, {:.3f}], \"free_activations\": {}}}\n",
               w0, w1, r0, r1, free_activations);
    for (std::size_t i = 0; i < settings.size(); ++i) {
      std::vector<double> ms;
      std::size_t peak = 0, activation_peak = 0, store_peak = 0, written = 0, late = 0, reads = 0, discards = 0,
                  to_disk = 0;
      bool infeasible = false, bitwise = true;
      for (const Sample& s : samples[i]) {
        ms.push_back(s.ms);
        peak = std::max(peak, s.peak);
        activation_peak = std::max(activation_peak, s.activation_peak);
        store_peak = std::max(store_peak, s.store_peak);
        written = std::max(written, s.written);
        discards = std::max(discards, s.discards);
        to_disk = std::max(to_disk, s.to_disk);
        late += s.late;
        reads += s.reads;
        infeasible = infeasible || s.infeasible;
        bitwise = bitwise && s.grads == samples[0].front().grads;  // settings[0] is none in RAM
      }
      const Setting& st = settings[i];
      const char* kind = st.budget_fraction > 0
                             ? (st.budget_disk ? "budget+disk" : st.offload ? "budget+offload" : "budget")
                             : (st.offload ? "offload" : "hand");
      fmt::print("{{\"setting\": \"{}\", \"kind\": \"{}\", \"budget\": {}, \"ms\": [{:.3f}], \"peak\": {}, "
                 "\"activation_peak\": {}, \"store_peak\": {}, \"written\": {}, \"late\": {}, \"reads\": {}, "
                 "\"discards\": {}, \"to_disk\": {}, \"infeasible\": {}, \"bitwise\": {}}}\n",
                 st.name, kind,
                 static_cast<std::size_t>(st.budget_fraction * static_cast<double>(free_activations)),
                 fmt::join(ms, ", "), peak, activation_peak, store_peak, written, late, reads, discards, to_disk,
                 infeasible, bitwise);
    }
    return 0;
  }

  fmt::print("GPT L {} d {} T {} B {}, dropout {}; {} rounds, settings alternating; offload to {} (min {} B, "
             "prefetch {})\n", cfg.n_layer, cfg.n_embd, T, B, cfg.dropout, rounds, a["dir"], base.min_bytes,
             base.prefetch);
  fmt::print("disk, O_DIRECT 1 MiB pieces of 512 MiB: write {:.2f} / {:.2f} GB/s, read {:.2f} / {:.2f} GB/s "
             "(before / after)\n\n", w0, w1, r0, r1);
  fmt::print("| setting | step ms, median (range) | × in RAM, median (range) | "
             "held at forward end MB, median (range) | step peak MB | store peak MB | books peak MB | written MB | "
             "late / reads, all rounds | bitwise |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|---|\n");
  std::string detail;
  auto mb = [](std::size_t b) { return static_cast<double>(b) / 1e6; };
  for (std::size_t i = 0; i < settings.size(); ++i) {
    std::vector<double> ms, held;
    std::size_t late = 0, reads = 0;
    for (const Sample& s : samples[i]) {
      ms.push_back(s.ms);
      held.push_back(mb(s.held));
      late += s.late;
      reads += s.reads;
    }
    const Sample& last = samples[i].back();
    std::size_t in_ram = 0;  // the same policy in RAM
    while (settings[in_ram].offload || settings[in_ram].policy != settings[i].policy) ++in_ram;
    bool bitwise = true;
    for (const Sample& s : samples[i]) bitwise = bitwise && s.grads == samples[in_ram].front().grads;
    // Each round's step over the same round's step in RAM: the two ran seconds apart, so a drift of
    // the machine's speed across rounds cancels in the ratio, where it widens both medians' ranges.
    std::vector<double> ratio;
    for (std::size_t r = 0; r < samples[i].size(); ++r) ratio.push_back(samples[i][r].ms / samples[in_ram][r].ms);
    fmt::print("| {} | {:.1f} ({:.1f}–{:.1f}) | {:.2f} ({:.2f}–{:.2f}) | {:.2f} ({:.2f}–{:.2f}) | {:.2f} | {:.2f} | "
               "{:.2f} | {:.2f} | {} / {} | {} |\n",
               settings[i].name, median(ms), *std::min_element(ms.begin(), ms.end()),
               *std::max_element(ms.begin(), ms.end()), median(ratio), *std::min_element(ratio.begin(), ratio.end()),
               *std::max_element(ratio.begin(), ratio.end()), median(held), *std::min_element(held.begin(), held.end()),
               *std::max_element(held.begin(), held.end()), mb(last.peak), mb(last.store_peak), mb(last.books_peak),
               mb(last.written), late, reads, bitwise ? "yes" : "NO");
    std::vector<double> fwd;
    for (const Sample& s : samples[i]) fwd.push_back(s.forward_ms);
    detail += fmt::format("| {} | {:.1f} | {:.1f} | {:.1f} / {:.1f} | {} |\n", settings[i].name, median(fwd),
                          last.wait_ms, last.write_ms, last.read_ms, last.called_off);
  }
  fmt::print("\nThe last round's details: forward ms (median), backward's wait for late reads, the I/O thread's "
             "time writing and reading, writes called off when backward began\n\n"
             "| setting | forward ms | wait ms | write / read ms | called off |\n|---|---|---|---|---|\n{}", detail);
}
