// libsentencepiece as a command, the oracle of tests/unit/tokenizer_test.cc (in a process of its
// own; see tests/CMakeLists.txt):
//   sentencepiece_tool train CORPUS PREFIX VOCAB   trains a BPE model with byte fallback
//   sentencepiece_tool decode MODEL ID...          prints libsentencepiece's decoding, hex-encoded
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  const std::string verb = argc > 1 ? argv[1] : "";
  if (verb == "train" && argc == 5) {
    const std::string args = std::string("--input=") + argv[2] + " --model_prefix=" + argv[3] +
                             " --vocab_size=" + argv[4] +
                             " --model_type=bpe --character_coverage=1.0 --byte_fallback=true" +
                             " --num_threads=1 --minloglevel=2";
    const auto st = sentencepiece::SentencePieceTrainer::Train(args);
    if (!st.ok()) std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return st.ok() ? 0 : 1;
  }
  if (verb == "decode" && argc >= 3) {
    sentencepiece::SentencePieceProcessor sp;
    const auto st = sp.Load(argv[2]);
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
    std::vector<int> ids;
    for (int i = 3; i < argc; ++i) ids.push_back(std::atoi(argv[i]));
    for (unsigned char c : sp.DecodeIds(ids)) std::printf("%02x", c);
    std::printf("\n");
    return 0;
  }
  std::fprintf(stderr,
               "usage: sentencepiece_tool train CORPUS PREFIX VOCAB | decode MODEL ID...\n");
  return 2;
}
