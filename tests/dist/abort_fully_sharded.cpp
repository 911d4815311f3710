// Under ZeRO-3 one rank throws between its forward and its backward; the others wait in backward's
// first all-gather for it. The Context must end every rank (tests/dist/abort.sh checks the exit
// status, the message and that it took seconds, not a hang).
#include <remat/remat.hpp>
#include <remat/dist/fully_sharded.hpp>
#include <remat/nn/gpt.hpp>

int main(int argc, char** argv) {
  using namespace remat;
  dist::Context ctx(&argc, &argv);
  nn::GPTConfig cfg;
  cfg.vocab_size = 13;
  cfg.block_size = 8;
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.n_embd = 16;
  Generator gen(1);
  nn::GPT model(cfg, gen);
  apply_checkpointing(model, policy::parse("blocks"));
  dist::FullyShardedDataParallel fsdp(ctx, model);
  const LongTensor x = randint(0, 13, Shape{2, 8}, gen), y = randint(0, 13, Shape{2, 8}, gen);
  Tensor loss = model.loss(x, y);
  if (ctx.rank() == 1) throw Error("a failure on purpose in rank 1");
  loss.backward();  // the others wait in the last block's gather for rank 1, which never comes
  return 0;
}
