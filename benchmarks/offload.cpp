// What offloading saved activations to disk costs in step time and saves in RAM: one GPT step per
// setting, settings alternating round by round, medians and ranges; the disk's own direct-I/O
// bandwidth measured in the same run, before and after.
//
//   bench_offload [--layers 8] [--width 256] [--heads 4] [--context 128] [--batch 8] [--vocab 256]
//                 [--dropout 0.1] [--rounds 7] [--dir /var/tmp] [--min 1048576] [--prefetch 4] [--direct 1]
//
// Settings: blocks in RAM; blocks with its boundaries offloaded (SavedBy::checkpoint); none in RAM;
// none with every saved tensor of at least --min offloaded. Columns: the step's wall time (forward
// and backward); what the step holds for backward when its forward ends (memory_stats()'s live
// bytes above the step's start, the store's tensors still waiting for their write included); the
// step's peak of live bytes above its start; the store's own peak RAM (waiting writes and the
// read-ahead arena); the saved-for-backward books' peak (what nodes hold themselves); the bytes
// written; late reads of reads; and whether the gradients are bitwise those of the same policy in RAM.

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
  const char* name;
  const char* policy;
  bool offload;
  bool boundaries_only;
};

struct Sample {
  double ms;
  std::size_t held, peak, store_peak, books_peak, written, late, reads, called_off;
  double forward_ms, wait_ms, write_ms, read_ms;
  std::vector<std::vector<float>> grads;
};

Sample step(nn::GPT& gpt, const Setting& s, const OffloadOptions& base, const LongTensor& idx,
            const LongTensor& targets) {
  for (Tensor* p : gpt.parameters()) p->zero_grad();
  manual_seed(2);
  Sample out{};
  const std::size_t start = memory_stats().live_bytes;
  MemoryScope scope;
  const auto t = Clock::now();
  {
    std::optional<Offload> offload;
    if (s.offload) {
      OffloadOptions o = base;
      if (s.boundaries_only) {
        o.min_bytes = 0;
        o.only = [](const AnyTensor&, const SaveContext& c) { return c.by == SavedBy::checkpoint; };
      }
      offload.emplace(o);
    }
    Tensor loss = gpt.loss(idx, targets);
    out.forward_ms = seconds_since(t) * 1e3;
    out.held = memory_stats().live_bytes - start;
    loss.backward();
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
                                       {"direct", "1"}},
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

  const std::vector<Setting> settings = {{"blocks, in RAM", "blocks", false, false},
                                         {"blocks, boundaries offloaded", "blocks", true, true},
                                         {"none, in RAM", "none", false, false},
                                         {"none, offloaded >= min", "none", true, false}};
  std::vector<std::unique_ptr<nn::GPT>> models;
  for (const Setting& s : settings) {
    Generator init(1);
    models.push_back(std::make_unique<nn::GPT>(cfg, init));
    if (std::string(s.policy) != "none") apply_checkpointing(*models.back(), policy::parse(s.policy));
  }
  const auto [w0, r0] = disk_bandwidth(a["dir"], std::size_t{512} << 20);
  std::vector<std::vector<Sample>> samples(settings.size());
  for (int r = 0; r < rounds + 1; ++r)  // round 0 warms up
    for (std::size_t i = 0; i < settings.size(); ++i) {
      Sample s = step(*models[i], settings[i], base, idx, targets);
      if (r > 0) samples[i].push_back(std::move(s));
    }
  const auto [w1, r1] = disk_bandwidth(a["dir"], std::size_t{512} << 20);

  fmt::print("GPT L {} d {} T {} B {}, dropout {}; {} rounds, settings alternating; offload to {} (min {} B, "
             "prefetch {})\n", cfg.n_layer, cfg.n_embd, T, B, cfg.dropout, rounds, a["dir"], base.min_bytes,
             base.prefetch);
  fmt::print("disk, O_DIRECT 1 MiB pieces of 512 MiB: write {:.2f} / {:.2f} GB/s, read {:.2f} / {:.2f} GB/s "
             "(before / after)\n\n", w0, w1, r0, r1);
  fmt::print("| setting | step ms, median (range) | held at forward end MB | step peak MB | store peak MB | "
             "books peak MB | written MB | late / reads | bitwise |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|\n");
  std::string detail;
  auto mb = [](std::size_t b) { return static_cast<double>(b) / 1e6; };
  for (std::size_t i = 0; i < settings.size(); ++i) {
    std::vector<double> ms;
    for (const Sample& s : samples[i]) ms.push_back(s.ms);
    const Sample& last = samples[i].back();
    const std::size_t in_ram = i % 2 == 0 ? i : i - 1;  // the same policy in RAM
    bool bitwise = true;
    for (const Sample& s : samples[i]) bitwise = bitwise && s.grads == samples[in_ram].front().grads;
    fmt::print("| {} | {:.1f} ({:.1f}–{:.1f}) | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {} / {} | {} |\n",
               settings[i].name, median(ms), *std::min_element(ms.begin(), ms.end()),
               *std::max_element(ms.begin(), ms.end()), mb(last.held), mb(last.peak), mb(last.store_peak),
               mb(last.books_peak), mb(last.written), last.late, last.reads, bitwise ? "yes" : "NO");
    std::vector<double> fwd;
    for (const Sample& s : samples[i]) fwd.push_back(s.forward_ms);
    detail += fmt::format("| {} | {:.1f} | {:.1f} | {:.1f} / {:.1f} | {} |\n", settings[i].name, median(fwd),
                          last.wait_ms, last.write_ms, last.read_ms, last.called_off);
  }
  fmt::print("\nThe last round's details: forward ms (median), backward's wait for late reads, the I/O thread's "
             "time writing and reading, writes called off when backward began\n\n"
             "| setting | forward ms | wait ms | write / read ms | called off |\n|---|---|---|---|---|\n{}", detail);
}
