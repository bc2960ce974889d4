// Python bindings: the module `_tsx_cpu` that turbospark_mlx/cpu_ext/__init__.py builds and loads.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "qmv.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_tsx_cpu, m) {
  m.def(
      "quantized_matmul",
      &turbospark::quantized_matmul,
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      nb::kw_only(),
      "stream"_a = nb::none());
  m.def("cpu_supported", &turbospark::cpu_supported);
  m.def("isa", &turbospark::isa);
  m.def("set_isa", &turbospark::set_isa, "name"_a);
}
