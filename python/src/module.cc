// epx._epx: the extension module. Each python/src/<part>.cc registers its
// classes and functions through one register_<part>(m), called here.
#include <pybind11/pybind11.h>

namespace pb = pybind11;

namespace epx::py {
void register_transport(pb::module_& m);
void register_buffer(pb::module_& m);
}  // namespace epx::py

PYBIND11_MODULE(_epx, m) {
  m.doc() = "epx: expert parallelism for MoE models (docs/python.md)";
  epx::py::register_transport(m);
  epx::py::register_buffer(m);
}
