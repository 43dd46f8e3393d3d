// The decode attention span loops (dense/attention_span.h) built for AVX2, multiply-adds contracted into FMA
// (CMakeLists.txt): a path of its own, bitwise reproducible within itself.
#include "dense/attention_span.h"

namespace hetmoe {
namespace avx2 {

void attention_span(const AttentionSpan& s) { span_impl(s); }

}  // namespace avx2
}  // namespace hetmoe
