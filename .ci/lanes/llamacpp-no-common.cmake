# Included by llama.cpp's CMakeLists.txt right after its project() call (CMAKE_PROJECT_llama.cpp_INCLUDE, set in
# llamacpp.txt). llama-cpp-python forces LLAMA_BUILD_COMMON on in its cache, but the Python package loads only
# libllama, libggml* and libmtmd; llama.cpp's common library and the cpp-httplib it links were 43 % of the build's
# compile time. A normal variable shadows the cached value in llama.cpp's directory scope (policy CMP0077), so
# neither is built nor installed; mtmd does not link common.
set(LLAMA_BUILD_COMMON OFF)
